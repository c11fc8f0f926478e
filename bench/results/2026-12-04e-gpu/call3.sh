# The GPU lane on this checkout (call3/tree-sums.txt), liger-kernel on the path, with the time the lane needs on a
# slow machine (2026-12-04d's 330 s limit cut it).
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W/lane
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL ${LANE_S:-560} python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -30 $W/lane/pytest.log; tar czf $OUT/call3.tgz -C $W .
