# after call 3's slow update: fitone's ops no longer link an OpenMP library of their own (0fde240's build linked the
# system libgomp beside the one a CUDA torch bundles). The exact fp32 pass alone on this host (adam32_speed.py, which
# builds it first), then t5-3b (fp16, 128/128, 23 GiB cap, fitone's defaults, 2 warm-up + 6 timed steps): current
# at 64, the reference d99474a at 64, current at 256
D=bench/results/2026-12-02e-gpu; source $D/prelude.sh
W=/tmp/o5; mkdir -p $W/adam32 $W/ref $W/now
timeout -s KILL 110 python3 $D/adam32_speed.py > $W/adam32/adam32-speed.log 2>&1; echo "exit $?" >> $W/adam32/adam32-speed.log
tar czf $OUT/call5.tgz -C $W .
run() {  # $1 ref|now, $2 micro-batch, $3 limit
  if [ $1 = ref ]; then
    (cd .ref-d99474a && PYTHONPATH=/tmp/site:$PWD timeout -s KILL $3 python3 scripts/bench_gpu.py --tools fitone --batch-sizes $2 --steps 6 --out $W/ref/ --budget $(($3 - 10)) >> $W/ref/bench.log 2>&1; echo "exit $? ($2)" >> $W/ref/bench.log)
  else
    timeout -s KILL $3 python3 scripts/bench_tools.py --tools fitone --batch-sizes $2 --steps 6 --out $W/now/ --budget $(($3 - 10)) >> $W/now/bench.log 2>&1; echo "exit $? ($2)" >> $W/now/bench.log
  fi
  tar czf $OUT/call5.tgz -C $W .
}
run now 64 115; run ref 64 115
left=$((445 - SECONDS)); [ $left -gt 60 ] && run now 256 $left
