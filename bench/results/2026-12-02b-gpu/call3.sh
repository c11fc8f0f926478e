# llama-7b at the recipe's 16 x 2 x 512: the fused LM head + loss against the model's own loss, 7 steps each, no export
D=bench/results/2026-12-02b-gpu; source $D/prelude.sh
W=/tmp/o; mkdir -p $W/llama-7b-loss
for loss in fused plain; do
  flag=$([ $loss = plain ] && echo fused_loss=false)
  OUT=$W/llama-7b-loss timeout -s KILL 215 python3 scripts/bench_train.py llama-7b-$loss --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=7 save_every=null eval_examples=0 out=/tmp/rl $flag --overwrite --no-progress > $W/llama-7b-loss/$loss.log 2>&1
  echo "exit $?" >> $W/llama-7b-loss/$loss.log; rm -rf /tmp/rl
done
tar czf $OUT/call3.tgz -C $W .
