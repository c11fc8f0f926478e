# the GPU lane on the final code, liger-kernel on the path (its equality test runs)
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
export PYTHONPATH=/tmp/liger:$PYTHONPATH
W=/tmp/o6; mkdir -p $W/lane
git log -1 --format=%H > $W/lane/commit 2>/dev/null; find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | sort | xargs cat | sha256sum > $W/lane/tree-sha256
FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 480 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/gpu-lane.log 2>&1
echo "exit $?" >> $W/lane/gpu-lane.log
tar czf $OUT/call6.tgz -C $W .
