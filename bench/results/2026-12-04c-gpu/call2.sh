# Issue 29: --speculative-update's first GPU run, t5-3b as in call 1 (fp16, 128/128, 23 GiB cap, micro-batches 8
# and 64, 20 timed steps and a split step); then llama-7b's recipe (16 x 2 x 512, bf16, 23 GiB cap, synthetic
# tokens, 10 steps, the first 3 untimed, no export) with the defaults and with --speculative-update, each alone.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/bench $W/llama-7b
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
timeout -s KILL 250 python3 scripts/bench_tools.py --tools fitone-speculative --batch-sizes 8,64 --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget 240 > $W/bench/bench.log 2>&1
echo "exit $?" >> $W/bench/bench.log; tail -12 $W/bench/bench.log; tar czf $OUT/call2.tgz -C $W .
for s in false true; do
  left=$(( 590 - SECONDS )); [ $left -gt 60 ] || break
  OUT=$W/llama-7b timeout -s KILL $left python3 scripts/bench_train.py llama-7b-speculative-$s --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic speculative_update=$s max_steps=10 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b/speculative-$s.log 2>&1
  echo "exit $? (limit $left s)" >> $W/llama-7b/speculative-$s.log; tail -2 $W/llama-7b/speculative-$s.log
  cp /tmp/rl/metrics.jsonl $W/llama-7b/speculative-$s-metrics.jsonl 2>/dev/null; rm -rf /tmp/rl
  tar czf $OUT/call2.tgz -C $W .
done
