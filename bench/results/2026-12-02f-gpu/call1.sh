# t5-3b at micro-batch 64 and 256 (fp16, 128/128, 23 GiB cap, fitone's defaults): the reference commit d99474a
# (git archive into .ref-d99474a/, its script then named bench_gpu.py) against the current code, after the exact
# fp32 pass reads fp16 through F16C block widening; the op is built first, outside the timed runs
D=bench/results/2026-12-02f-gpu; source $D/prelude.sh
W=/tmp/o1; mkdir -p $W/ref $W/now
s=$SECONDS; python3 -c "from fitone.zero2 import adam32; print('op available:', adam32.available())" > $W/op-build.log 2>&1
echo "exit $? after $((SECONDS - s)) s" >> $W/op-build.log
tar czf $OUT/ext.tgz -C /tmp ext  # the builds this machine made, for the next calls
for b in 64 256; do
  left=$(( 595 - SECONDS )); lim=$(( left < 132 ? left : 132 ))
  timeout -s KILL $lim python3 scripts/bench_tools.py --tools fitone --batch-sizes $b --steps 8 --out $W/now/ --budget 120 >> $W/now/bench.log 2>&1
  echo "exit $? ($b, limit $lim s)" >> $W/now/bench.log
  tar czf $OUT/call1.tgz -C $W .
  left=$(( 595 - SECONDS )); lim=$(( left < 132 ? left : 132 ))
  (cd .ref-d99474a && PYTHONPATH=/tmp/site:$PWD timeout -s KILL $lim python3 scripts/bench_gpu.py --tools fitone --batch-sizes $b --steps 8 --out $W/ref/ --budget 120 >> $W/ref/bench.log 2>&1; echo "exit $? ($b, limit $lim s)" >> $W/ref/bench.log)
  tar czf $OUT/call1.tgz -C $W .
done
