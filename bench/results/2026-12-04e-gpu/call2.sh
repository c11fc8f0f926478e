# Bars 1 and 2 side by side in one run: t5-3b (fp16, 128/128, 23 GiB cap for all but the uncapped loop), micro-batches
# 8 and 64, 2 warm-up (continued while the last step was skipped, for every tool) + 20 timed steps: stock DeepSpeed,
# --speculative-update (its Adam leaving one core to the backward), the plain all-GPU loop uncapped, then fitone's
# defaults with what is left of the budget.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
timeout -s KILL 560 python3 scripts/bench_tools.py --tools deepspeed,fitone-speculative,torch-plain-uncapped,fitone --batch-sizes 8,64 --same-process --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget 550 > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s" >> $W/bench/bench.log; tail -24 $W/bench/bench.log
tar czf $OUT/call2.tgz -C $W .
