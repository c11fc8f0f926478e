# 2026-12-08 call 3: the whole GPU lane on this tree, then llama-7b's recipe as it ships (share 0.4; 16 x 2 x 512,
# bf16, clip 1.0, 23 GiB cap, synthetic tokens, 10 steps, the first 3 untimed) if time is left.
source bench/results/2026-12-08-gpu/prelude.sh
W=/tmp/c3; mkdir -p $W/lane
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL $(( 430 - SECONDS )) python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -n 5 $W/lane/pytest.log
left=$(( 585 - SECONDS ))
if [ $left -gt 150 ]; then
  OUT=$W timeout -s KILL $left python3 scripts/bench_train.py llama-7b-recipe --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=10 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama.log 2>&1
  echo "exit $? (limit $left s, at $SECONDS s)" >> $W/llama.log; tail -n 2 $W/llama.log | cut -c1-300
  cp /tmp/rl/metrics.jsonl $W/llama-metrics.jsonl 2>/dev/null
fi
tar czf $OUT/call3.tgz -C $W .
