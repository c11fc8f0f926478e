# Issue 29 on the committed tree (2026-12-04c-gpu/call2.sh reordered, on a fresh machine: the ops are built first,
# BUILD_OPS=1, and come back as ext.tgz). Bar 3 first: llama-7b's recipe (16 x 2 x 512, bf16, 23 GiB cap, synthetic
# tokens, 10 steps, the first 3 untimed, no export) with the defaults; then --speculative-update's first GPU run,
# t5-3b as in 2026-12-04c-gpu/call1 (fp16, 128/128, 23 GiB cap, micro-batches 8 and 64, 20 timed steps and a split
# step); then llama-7b's recipe with --speculative-update if the call has time left.
BUILD_OPS=1 source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/bench $W/llama-7b
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
llama() {  # $1: speculative_update false/true; $2: the most seconds it may take
  OUT=$W/llama-7b timeout -s KILL $2 python3 scripts/bench_train.py llama-7b-speculative-$1 --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic speculative_update=$1 max_steps=10 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b/speculative-$1.log 2>&1
  echo "exit $? (limit $2 s)" >> $W/llama-7b/speculative-$1.log; tail -2 $W/llama-7b/speculative-$1.log
  cp /tmp/rl/metrics.jsonl $W/llama-7b/speculative-$1-metrics.jsonl 2>/dev/null; rm -rf /tmp/rl
  tar czf $OUT/call1.tgz -C $W .
}
llama false 220
left=$(( 585 - SECONDS )); [ $left -gt 250 ] && left=250
timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone-speculative --batch-sizes 8,64 --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 10 )) > $W/bench/bench.log 2>&1
echo "exit $? (limit $left s)" >> $W/bench/bench.log; tail -12 $W/bench/bench.log; tar czf $OUT/call1.tgz -C $W .
left=$(( 590 - SECONDS )); [ $left -gt 100 ] && llama true $left
echo "call took $SECONDS s"
