# t5-3b at micro-batch 64 and 256: fitone's default (Adam's 16-bit gradients widened a 32M-element chunk at a
# time) against 8M-element slices, in one run; then 2M-element slices at 64 if the time allows
D=bench/results/2026-12-02d-gpu; source $D/prelude.sh
W=/tmp/o1; mkdir -p $W/t5-ab $W/t5-2m
timeout -s KILL 430 python3 scripts/bench_tools.py --tools fitone,fitone-widen-8m --batch-sizes 64,256 --out $W/t5-ab/ --budget 410 > $W/t5-ab/bench.log 2>&1
echo "exit $?" >> $W/t5-ab/bench.log
tar czf $OUT/call1.tgz -C $W .
left=$((560 - SECONDS))
if [ $left -gt 100 ]; then
  timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone-widen-2m --batch-sizes 64 --out $W/t5-2m/ --budget $((left - 15)) > $W/t5-2m/bench.log 2>&1
  echo "exit $? (limit $left s)" >> $W/t5-2m/bench.log
fi
tar czf $OUT/call1.tgz -C $W .
