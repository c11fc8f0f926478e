# the exact fp32 pass alone on this host (adam32_speed.py: why call 3's update took 2.5 s), then llama-7b at the
# recipe's 16 x 2 x 512: the model's own loss first, then the fused one (Liger's, forced at 32k by bench_train's
# --loss any-vocab), 7 steps each, no export: the A/B of ../2026-12-02b-gpu/call3.sh in the other order
D=bench/results/2026-12-02e-gpu; source $D/prelude.sh
export PYTHONPATH=/tmp/liger:$PYTHONPATH
W=/tmp/o4; mkdir -p $W/adam32 $W/llama-7b-loss
timeout -s KILL 100 python3 $D/adam32_speed.py > $W/adam32/adam32-speed.log 2>&1; echo "exit $?" >> $W/adam32/adam32-speed.log
tar czf $OUT/call4.tgz -C $W .
for loss in own fused; do
  flag=$([ $loss = fused ] && echo "--loss any-vocab")
  [ $loss = own ] && left=$(( (560 - SECONDS) / 2 )) || left=$((560 - SECONDS))
  OUT=$W/llama-7b-loss timeout -s KILL $left python3 scripts/bench_train.py llama-7b-$loss --no-export $flag -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=7 save_every=null eval_examples=0 out=/tmp/rl --overwrite --no-progress > $W/llama-7b-loss/$loss.log 2>&1
  echo "exit $? (limit $left s)" >> $W/llama-7b-loss/$loss.log; rm -rf /tmp/rl
  tar czf $OUT/call4.tgz -C $W .
done
