# t5-3b: 8 steps at 16 x 2 with a checkpoint save at step 8 (the host's peak while saving), then the export
D=bench/results/2026-12-02c-gpu; rm -rf /tmp/site; source $D/prelude.sh
W=/tmp/o4; mkdir -p $W/t5-3b-save
python3 -m fitone plan --recipe t5-3b/24gb model=t5-3b from_scratch=true batch_size=16 global_batch=32 --json > $W/t5-3b-save/plan.json 2>$W/t5-3b-save/plan.err
OUT=$W/t5-3b-save timeout -s KILL 250 python3 scripts/bench_train.py t5-3b-save -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic batch_size=16 global_batch=32 max_steps=8 save_every=8 eval_examples=0 out=/tmp/run-t5 --overwrite --no-progress > $W/t5-3b-save/t5-3b-save.log 2>&1
echo "exit $?" >> $W/t5-3b-save/t5-3b-save.log
du -sh /tmp/run-t5/* /tmp/run-t5/*/* > $W/t5-3b-save/du.txt 2>&1; cp /tmp/run-t5/metrics.jsonl $W/t5-3b-save/ 2>/dev/null; rm -rf /tmp/run-t5
tar czf $OUT/call4.tgz -C $W .
