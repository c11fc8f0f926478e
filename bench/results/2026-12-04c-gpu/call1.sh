# Issue 29's bars 1, 2 and 4 on today's code, side by side in one run: t5-3b from its config, fp16, 128/128 tokens,
# stock DeepSpeed ZeRO-2 offload and fitone (defaults: the pipelined update) under the 23 GiB cap, and the plain
# all-GPU PyTorch loop uncapped; micro-batches 8 and 64, 2 warm-up and 20 timed steps, then one split step.
# First DeepSpeed's CPU Adam and fitone's two ops are built (BUILD_OPS=1); they come back as ext.tgz.
BUILD_OPS=1 source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
timeout -s KILL 520 python3 scripts/bench_tools.py --tools deepspeed,fitone,torch-plain-uncapped --batch-sizes 8,64 --same-process --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget 500 > $W/bench/bench.log 2>&1
echo "exit $?" >> $W/bench/bench.log; tail -30 $W/bench/bench.log
tar czf $OUT/call1.tgz -C $W .
