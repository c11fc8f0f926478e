# Mistral-7B: plan, then 20 steps at the recipe's 16 x 2 x 512 and the export; t5-3b: 8 steps at 16 x 2 with a save at step 8
D=bench/results/2026-12-02b-gpu; source $D/prelude.sh
W=/tmp/o; mkdir -p $W/mistral-7b $W/t5-3b-save
python3 -m fitone plan --recipe mistral-7b/24gb model=mistral-7b from_scratch=true --json > $W/mistral-7b/plan.json 2>$W/mistral-7b/plan.err
OUT=$W/mistral-7b timeout 300 python3 scripts/bench_train.py mistral-7b -- train --recipe mistral-7b/24gb model=mistral-7b from_scratch=true data=synthetic max_steps=20 save_every=null eval_examples=0 out=/tmp/rm --overwrite --no-progress > $W/mistral-7b/mistral-7b.log 2>&1
echo "exit $?" >> $W/mistral-7b/mistral-7b.log
ls -la /tmp/rm/final > $W/mistral-7b/final-ls.txt 2>&1; cp /tmp/rm/metrics.jsonl $W/mistral-7b/ 2>/dev/null; rm -rf /tmp/rm
python3 -m fitone plan --recipe t5-3b/24gb model=t5-3b from_scratch=true batch_size=16 global_batch=32 --json > $W/t5-3b-save/plan.json 2>$W/t5-3b-save/plan.err
OUT=$W/t5-3b-save timeout 170 python3 scripts/bench_train.py t5-3b-save -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic batch_size=16 global_batch=32 max_steps=8 save_every=8 eval_examples=0 out=/tmp/run-t5 --overwrite --no-progress > $W/t5-3b-save/t5-3b-save.log 2>&1
echo "exit $?" >> $W/t5-3b-save/t5-3b-save.log
du -sh /tmp/run-t5/* /tmp/run-t5/*/* > $W/t5-3b-save/du.txt 2>&1; cp /tmp/run-t5/metrics.jsonl $W/t5-3b-save/ 2>/dev/null; rm -rf /tmp/run-t5
tar czf $OUT/call2.tgz -C $W .
