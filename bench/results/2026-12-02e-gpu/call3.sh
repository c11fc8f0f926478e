# t5-3b at micro-batch 64 and 256 (fp16, 128/128, 23 GiB cap, fitone's defaults): the reference commit d99474a
# (git archive into .ref-d99474a/, its script then named bench_gpu.py) against the current code, interleaved,
# 2 warm-up steps and the median of 10 timed steps each
D=bench/results/2026-12-02e-gpu; source $D/prelude.sh
W=/tmp/o3; mkdir -p $W/ref $W/now
for b in 64 256; do
  (cd .ref-d99474a && PYTHONPATH=/tmp/site:$PWD timeout -s KILL 140 python3 scripts/bench_gpu.py --tools fitone --batch-sizes $b --steps 10 --out $W/ref/ --budget 125 >> $W/ref/bench.log 2>&1; echo "exit $? ($b)" >> $W/ref/bench.log)
  timeout -s KILL 140 python3 scripts/bench_tools.py --tools fitone --batch-sizes $b --steps 10 --out $W/now/ --budget 125 >> $W/now/bench.log 2>&1
  echo "exit $? ($b)" >> $W/now/bench.log
  tar czf $OUT/call3.tgz -C $W .
done
