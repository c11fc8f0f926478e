# The GPU lane on this folder's tree (fitone/ and tests/ with their sums: the from-scratch model built on the GPU
# in the engine's dtype, checked by test_train_gpu.py), liger-kernel on the path.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W/lane; export PYTHONPATH=/tmp/liger:$PYTHONPATH
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 420 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/pytest.log 2>&1
echo "exit $?" >> $W/lane/pytest.log; tail -25 $W/lane/pytest.log
tar czf $OUT/call3.tgz -C $W .
