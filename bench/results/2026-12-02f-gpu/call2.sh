# call 1 again with longer limits (its current-code runs were cut by --budget 120 before their records): t5-3b at
# 64 and 256, the reference d99474a and the current code in one call, each child given up to 150 s (--budget 160)
D=bench/results/2026-12-02f-gpu; source $D/prelude.sh
W=/tmp/o2; mkdir -p $W/ref $W/now
ref() { (cd .ref-d99474a && PYTHONPATH=/tmp/site:$PWD timeout -s KILL $2 python3 scripts/bench_gpu.py --tools fitone --batch-sizes $1 --steps 8 --out $W/ref/ --budget 160 >> $W/ref/bench.log 2>&1; echo "exit $? ($1, limit $2 s)" >> $W/ref/bench.log); }
now() { timeout -s KILL $2 python3 scripts/bench_tools.py --tools fitone --batch-sizes $1 --steps 8 --out $W/now/ --budget 160 >> $W/now/bench.log 2>&1; echo "exit $? ($1, limit $2 s)" >> $W/now/bench.log; }
for run in "ref 64" "now 64" "now 256" "ref 256"; do
  left=$(( 595 - SECONDS )); lim=$(( left < 170 ? left : 170 ))
  [ $lim -gt 60 ] && $run $lim
  tar czf $OUT/call2.tgz -C $W .
done
