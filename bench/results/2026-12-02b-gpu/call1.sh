# Qwen3-8B: plan, then 20 steps at the recipe's 12 x 4 x 512 and the export; t5-3b: 20 steps at 16 x 2 with a save at step 20
D=bench/results/2026-12-02b-gpu; source $D/prelude.sh
mkdir -p $OUT/qwen3-8b $OUT/t5-3b-save
python3 -m fitone plan --recipe qwen3-8b/24gb model=qwen3-8b from_scratch=true --json > $OUT/qwen3-8b/plan.json 2>$OUT/qwen3-8b/plan.err
timeout 380 python3 scripts/bench_train.py qwen3-8b -- train --recipe qwen3-8b/24gb model=qwen3-8b from_scratch=true data=synthetic max_steps=20 save_every=null eval_examples=0 out=/tmp/r3 --overwrite --no-progress > $OUT/qwen3-8b/qwen3-8b.log 2>&1
echo "exit $?" >> $OUT/qwen3-8b/qwen3-8b.log
ls -la /tmp/r3/final > $OUT/qwen3-8b/final-ls.txt 2>&1; cp /tmp/r3/metrics.jsonl $OUT/qwen3-8b/ 2>/dev/null; rm -rf /tmp/r3
mv $OUT/bench7b-qwen3-8b*.json $OUT/qwen3-8b/ 2>/dev/null
python3 -m fitone plan --recipe t5-3b/24gb model=t5-3b from_scratch=true batch_size=16 global_batch=32 --json > $OUT/t5-3b-save/plan.json 2>$OUT/t5-3b-save/plan.err
timeout 170 python3 scripts/bench_train.py t5-3b-save -- train --recipe t5-3b/24gb model=t5-3b from_scratch=true data=synthetic batch_size=16 global_batch=32 max_steps=20 save_every=20 eval_examples=0 out=/tmp/run-t5 --overwrite --no-progress > $OUT/t5-3b-save/t5-3b-save.log 2>&1
echo "exit $?" >> $OUT/t5-3b-save/t5-3b-save.log
du -sh /tmp/run-t5/* /tmp/run-t5/*/* > $OUT/t5-3b-save/du.txt 2>&1; cp /tmp/run-t5/metrics.jsonl $OUT/t5-3b-save/ 2>/dev/null; rm -rf /tmp/run-t5
mv $OUT/bench7b-t5-3b-save*.json $OUT/t5-3b-save/ 2>/dev/null
[ -d /tmp/ext ] && tar czf $OUT/ext.tgz -C /tmp ext
