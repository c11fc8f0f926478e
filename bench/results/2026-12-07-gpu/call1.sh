# The first step speculated (NOTES 2026-12-07): bars 1, 2 and 4 side by side in one run, as 2026-12-06b-gpu/call1.sh:
# t5-3b (fp16, 128/128, 23 GiB cap for all but the uncapped loop), micro-batches 8 and 64, 2 warm-up (continued
# while the last step was skipped) + 20 timed steps and a split step: stock DeepSpeed, --speculative-update, then the
# plain all-GPU loop uncapped. The ops are built first (BUILD_OPS=1) and come back as ext.tgz.
BUILD_OPS=1 source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/bench
cp /tmp/build-*.log $W/ 2>/dev/null
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
left=$(( 585 - SECONDS ))
timeout -s KILL $left python3 scripts/bench_tools.py --tools deepspeed,fitone-speculative,torch-plain-uncapped --batch-sizes 8,64 --same-process --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 12 )) > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -24 $W/bench/bench.log
tar czf $OUT/call1.tgz -C $W .
