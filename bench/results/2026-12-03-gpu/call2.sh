# llama-7b at the recipe's 16 x 2 x 512: the model's own loss and Liger's fused loss alternating step by step in one
# engine (bench_train's --loss alternate), 18 steps: an A/B no run order or machine drift can tilt
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
export PYTHONPATH=/tmp/liger:$PYTHONPATH
W=/tmp/o2; mkdir -p $W/llama-7b-alt
OUT=$W/llama-7b-alt timeout -s KILL 540 python3 scripts/bench_train.py llama-7b-alt --no-export --loss alternate -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=18 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b-alt/run.log 2>&1
echo "exit $?" >> $W/llama-7b-alt/run.log; cp /tmp/rl/metrics.jsonl $W/llama-7b-alt/ 2>/dev/null; rm -rf /tmp/rl
tar czf $OUT/call2.tgz -C $W .
