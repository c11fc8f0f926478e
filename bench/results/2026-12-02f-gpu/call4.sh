# llama-7b at the recipe's 16 x 2 x 512: the model's own loss first, then the fused one (Liger's, forced at 32k by
# bench_train's --loss any-vocab), 7 steps each, no export: the A/B of ../2026-12-02b-gpu/call3.sh in the other order
D=bench/results/2026-12-02f-gpu; source $D/prelude.sh
export PYTHONPATH=/tmp/liger:$PYTHONPATH
W=/tmp/o4; mkdir -p $W/llama-7b-loss
for loss in own fused; do
  flag=$([ $loss = fused ] && echo "--loss any-vocab")
  [ $loss = own ] && left=$(( (420 - SECONDS) / 2 )) || left=$((420 - SECONDS))
  OUT=$W/llama-7b-loss timeout -s KILL $left python3 scripts/bench_train.py llama-7b-$loss --no-export $flag -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=7 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b-loss/$loss.log 2>&1
  echo "exit $? (limit $left s)" >> $W/llama-7b-loss/$loss.log; rm -rf /tmp/rl
  tar czf $OUT/call4.tgz -C $W .
done
