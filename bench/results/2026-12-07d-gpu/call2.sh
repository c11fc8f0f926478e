# 2026-12-07d call 2: the whole GPU lane (`pytest -m gpu`) on this tree, under a 570 s limit, on call 1's warm H100.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/d2; mkdir -p $W
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W timeout -s KILL 570 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/pytest.log; tail -n 30 $W/pytest.log; tar czf $OUT/call2.tgz -C $W .
