# The GPU lane on this checkout (call3/tree-sums.txt; with the first step in the update's thread and the new
# speculative-update test), liger-kernel on the path; then t5-3b (fp16, 128/128, 23 GiB cap, micro-batches 8 and
# 64, 2 warm-up and 20 timed steps, one split step) with --speculative-update and with the defaults, one run.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W/lane $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 330 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -4 $W/lane/pytest.log; tar czf $OUT/call3.tgz -C $W .
left=$(( 585 - SECONDS ))
timeout -s KILL $left python3 scripts/bench_tools.py --tools fitone-speculative,fitone --batch-sizes 8,64 --warmup 2 --steps 20 --split-steps 1 --out $W/bench/ --log-dir --budget $(( left - 10 )) > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -14 $W/bench/bench.log
tar czf $OUT/call3.tgz -C $W .
