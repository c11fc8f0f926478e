# The GPU lane on this checkout (call2/tree-sums.txt), liger-kernel on the path: the ops come from call 1's
# ext.tgz when carried as .ext/ext.tgz (or are left on a warm machine), else the lane builds them itself.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/lane
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
PYTHONPATH=/tmp/liger:$PYTHONPATH FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL ${LANE_S:-560} python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane/pytest.log; tail -30 $W/lane/pytest.log; tar czf $OUT/call2.tgz -C $W .
