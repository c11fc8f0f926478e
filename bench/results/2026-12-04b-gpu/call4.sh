# The GPU lane again after call 3's failure (the test's monkeypatch took `fitone.train`, the package's train()
# function, for the module), on this folder's tree with its sums, liger-kernel on the path; then issue 31's speed
# bar on t5-3b a second time (2026-12-04-gpu/call3's runs: bf16 training, 64 x 2 x 128/128, 20 steps, no export),
# the exact mode then --optimizer-states bf16, one after the other, each killed at 150 s.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o4; mkdir -p $W/lane
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 300 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $?" >> $W/lane/pytest.log; tail -4 $W/lane/pytest.log
for s in fp32 bf16; do
  mkdir -p $W/t5-3b-$s
  OUT=$W/t5-3b-$s timeout -s KILL 150 python3 scripts/bench_train.py t5-3b-states-$s --no-export -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic precision=bf16 optimizer_states=$s batch_size=64 global_batch=128 max_steps=20 save_every=null eval_examples=0 out=/tmp/r3 --overwrite --no-progress > $W/t5-3b-$s/run.log 2>&1
  echo "exit $?" >> $W/t5-3b-$s/run.log; tail -2 $W/t5-3b-$s/run.log; cp /tmp/r3/metrics.jsonl $W/t5-3b-$s/ 2>/dev/null; rm -rf /tmp/r3
done
tar czf $OUT/call4.tgz -C $W .
