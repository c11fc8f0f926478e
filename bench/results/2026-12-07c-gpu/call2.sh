# 2026-12-07c call 2 (NOTES 2026-12-07c): the whole GPU lane (`pytest -m gpu`, the new test_gpu_adam_gpu.py in it),
# then t5-3b (fp16, 128/128, 23 GiB cap) at micro-batches 8 and 64, 2 warm-up + 12 timed steps and a split step,
# side by side in one process: fitone's defaults (the pipelined update) and with --gpu-adam-share 0.33. The ops
# from call 1's ext.tgz, carried as .ext/ext.tgz (or left on a warm machine).
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/lane $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL ${LANE_S:-330} python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -25 $W/lane/pytest.log; tar czf $OUT/call2.tgz -C $W .
left=$(( 585 - SECONDS ))
if [ $left -gt 150 ]; then
  timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone,fitone-share --batch-sizes 8,64 --same-process --warmup 2 --steps 12 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 12 )) > $W/bench/bench.log 2>&1
  echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -12 $W/bench/bench.log
fi
echo "call took $SECONDS s"; tar czf $OUT/call2.tgz -C $W .
