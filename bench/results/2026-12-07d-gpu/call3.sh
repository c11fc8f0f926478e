# 2026-12-07d call 3: t5-3b (fp16, 128/128, 23 GiB cap) at micro-batches 8 and 64, 2 warm-up + 12 timed steps and
# a split step, side by side in one process: fitone's defaults (the pipelined update) and --gpu-adam-share 0.4.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/d3; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
left=$(( 560 - SECONDS ))
timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone,fitone-share --batch-sizes 8,64 --same-process --warmup 2 --steps 12 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 12 )) > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -n 14 $W/bench/bench.log
tar czf $OUT/call3.tgz -C $W .
