# t5-3b in bf16 (the 16-bit states need bf16 training) at 64 x 2 x 128/128, 20 steps and the export, the exact mode
# then --optimizer-states bf16, one after the other in one call: issue 31's t5-3b host bar (<= 25.6 GiB) and speed
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
W=/tmp/o5
for s in fp32 bf16; do
  mkdir -p $W/t5-3b-$s
  OUT=$W/t5-3b-$s timeout -s KILL 260 python3 scripts/bench_train.py t5-3b-states-$s -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic precision=bf16 optimizer_states=$s batch_size=64 global_batch=128 max_steps=20 save_every=null eval_examples=0 out=/tmp/r5 --overwrite --no-progress > $W/t5-3b-$s/run.log 2>&1
  echo "exit $?" >> $W/t5-3b-$s/run.log; cp /tmp/r5/metrics.jsonl $W/t5-3b-$s/ 2>/dev/null; rm -rf /tmp/r5
done
tar czf $OUT/call5.tgz -C $W .
