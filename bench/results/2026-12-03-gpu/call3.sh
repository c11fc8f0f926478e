# llama-7b at the recipe's 16 x 2 x 512 with the optimizer's host state in bf16 (--optimizer-states bf16: stochastic
# rounding), 20 steps and the export: issue 31's host bar (<= 56.4 GiB) and its speed against the exact mode's
# (call 2); then the JIT builds, fitone_adam16 among them, for the next calls
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
W=/tmp/o3; mkdir -p $W/llama-7b-bf16
OUT=$W/llama-7b-bf16 timeout -s KILL 500 python3 scripts/bench_train.py llama-7b-bf16 -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic optimizer_states=bf16 max_steps=20 save_every=null eval_examples=0 out=/tmp/r7 --overwrite --no-progress > $W/llama-7b-bf16/run.log 2>&1
echo "exit $?" >> $W/llama-7b-bf16/run.log; cp /tmp/r7/metrics.jsonl $W/llama-7b-bf16/ 2>/dev/null; ls -la /tmp/r7/final > $W/llama-7b-bf16/final-ls.txt 2>&1; rm -rf /tmp/r7
tar czf $OUT/call3.tgz -C $W .
tar czf $OUT/ext.tgz -C /tmp ext
