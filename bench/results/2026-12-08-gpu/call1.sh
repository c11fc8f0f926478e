# (ran on commit 4271b3d, where HOST_CAST was on and the A/B tool was fitone-gpu-cast; today: --tools fitone-host-cast,fitone)
# 2026-12-08 call 1 (NOTES 2026-12-08): t5-3b (fp16, 128/128, 23 GiB cap) at micro-batches 8 and 64, 2 warm-up + 10
# timed steps and a split step, side by side in one run: fitone's defaults (the cast on the host) and
# fitone-gpu-cast (the fp32 master sent up and cast on the GPU, as before). Builds the ops first (BUILD_OPS=1).
BUILD_OPS=1 source bench/results/2026-12-08-gpu/prelude.sh
W=/tmp/c1; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
left=$(( 580 - SECONDS ))
timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone,fitone-gpu-cast --batch-sizes 8,64 --same-process --warmup 2 --steps 10 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 12 )) > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -n 14 $W/bench/bench.log
tar czf $OUT/call1.tgz -C $W .
