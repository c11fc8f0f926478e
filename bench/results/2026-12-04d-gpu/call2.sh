# Issue 29's bars 1, 2 and 4 after the first step moved into the update's thread and the speculation lost its
# backup (this checkout: call2/tree-sums.txt). t5-3b from its config, fp16, 128/128 tokens, under the 23 GiB cap:
# stock DeepSpeed ZeRO-2 offload, fitone (defaults: the pipelined update) and fitone with --speculative-update;
# the plain all-GPU PyTorch loop uncapped (first: the new runs before the longest one); micro-batches 8 and 64, 2 warm-up and 20 timed steps, one split step.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
timeout -s KILL 560 python3 scripts/bench_tools.py --tools torch-plain-uncapped,fitone-speculative,fitone,deepspeed --batch-sizes 8,64 --same-process --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget 550 > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s" >> $W/bench/bench.log; tail -32 $W/bench/bench.log
tar czf $OUT/call2.tgz -C $W .
