# The GPU lane on this checkout (call2/tree-sums.txt), liger-kernel on the path, the ops from call 1's ext.tgz
# carried as .ext/ext.tgz (or left on a warm machine). Then, with what is left of the call, bar 3: llama-7b's
# recipe (16 x 2 x 512, bf16, 23 GiB cap, synthetic tokens, 10 steps, the first 3 untimed, no export) with
# --speculative-update and grad_clip=100 (no step clips).
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/lane $W/llama-7b
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL ${LANE_S:-400} python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -30 $W/lane/pytest.log; tar czf $OUT/call2.tgz -C $W .
left=$(( 590 - SECONDS ))
if [ $left -gt 150 ]; then
  OUT=$W/llama-7b timeout -s KILL $left python3 scripts/bench_train.py llama-7b-speculative --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic speculative_update=true grad_clip=100 max_steps=10 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b/speculative.log 2>&1
  echo "exit $? (limit $left s)" >> $W/llama-7b/speculative.log; tail -3 $W/llama-7b/speculative.log
  cp /tmp/rl/metrics.jsonl $W/llama-7b/speculative-metrics.jsonl 2>/dev/null
fi
echo "call took $SECONDS s"; tar czf $OUT/call2.tgz -C $W .
