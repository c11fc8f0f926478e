# Llama-2-13B from its published config, under an 80 GB card's cap (79 GiB) on the 128 GiB host, with the
# optimizer's host state in bf16 (the exact mode needs ~175 GiB): issue 31's reach bar. The recipe's 32 x 2 x 512,
# 8 steps and the export, then the export loaded with from_pretrained in a fresh process
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
W=/tmp/o4; mkdir -p $W/llama-2-13b
OUT=$W/llama-2-13b timeout -s KILL 420 python3 scripts/bench_train.py llama-2-13b -- train --recipe llama-2-13b/80gb model=llama-2-13b from_scratch=true data=synthetic max_steps=8 save_every=null eval_examples=0 out=/tmp/r13 --overwrite --no-progress > $W/llama-2-13b/run.log 2>&1
echo "exit $?" >> $W/llama-2-13b/run.log; cp /tmp/r13/metrics.jsonl $W/llama-2-13b/ 2>/dev/null; ls -la /tmp/r13/final > $W/llama-2-13b/final-ls.txt 2>&1
timeout -s KILL 150 python3 scripts/check_export.py /tmp/r13/final --out $W/llama-2-13b > $W/llama-2-13b/check-export.log 2>&1; echo "check exit $?" >> $W/llama-2-13b/check-export.log
rm -rf /tmp/r13
tar czf $OUT/call4.tgz -C $W .
