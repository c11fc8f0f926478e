# Mistral-7B: the recipe (the model's own loss since 32k < 65,536), 20 steps and the export
D=bench/results/2026-12-02c-gpu; rm -rf /tmp/site; source $D/prelude.sh
W=/tmp/o3; mkdir -p $W/mistral-7b
python3 -m fitone plan --recipe mistral-7b/24gb model=mistral-7b from_scratch=true data=synthetic --json > $W/mistral-7b/plan.json 2> $W/mistral-7b/plan.err
OUT=$W/mistral-7b timeout -s KILL 420 python3 scripts/bench_train.py mistral-7b -- train --recipe mistral-7b/24gb model=mistral-7b from_scratch=true data=synthetic max_steps=20 save_every=null eval_examples=0 out=/tmp/rm --overwrite --no-progress > $W/mistral-7b/mistral-7b.log 2>&1
echo "exit $?" >> $W/mistral-7b/mistral-7b.log
ls -la /tmp/rm/final > $W/mistral-7b/final-ls.txt 2>&1; cp /tmp/rm/metrics.jsonl $W/mistral-7b/ 2>/dev/null; rm -rf /tmp/rm
tar czf $OUT/call3.tgz -C $W .
