# Issue 31's speed bar on t5-3b after dab63e4 (adam16.cpp's faster rounding): 2026-12-03-gpu/call5's runs again
# (bf16 training, 64 x 2 x 128/128, 20 steps, no export), the exact mode then --optimizer-states bf16, one after
# the other; before them the two CPU steps alone on 16 threads (scripts/bench_cpu_adam.py --fused16, 2^27
# elements: the exact mode's widening + fused AdamW against fitone's fused 16-bit op).
source bench/results/2026-12-03-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W
timeout 150 python3 scripts/bench_cpu_adam.py --elements 134217728 --fused16 > $W/cpu-adam.txt 2>&1
for s in fp32 bf16; do
  mkdir -p $W/t5-3b-$s
  OUT=$W/t5-3b-$s timeout -s KILL 200 python3 scripts/bench_train.py t5-3b-states-$s --no-export -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic precision=bf16 optimizer_states=$s batch_size=64 global_batch=128 max_steps=20 save_every=null eval_examples=0 out=/tmp/r3 --overwrite --no-progress > $W/t5-3b-$s/run.log 2>&1
  echo "exit $?" >> $W/t5-3b-$s/run.log; cp /tmp/r3/metrics.jsonl $W/t5-3b-$s/ 2>/dev/null; rm -rf /tmp/r3
done
tar czf $OUT/call3.tgz -C $W .
