# the GPU lane on the current code, then (time permitting) probe-batch on Llama-3.1-8B's recipe
D=bench/results/2026-12-02c-gpu; source $D/prelude.sh
W=/tmp/o; mkdir -p $W/lane $W/probe
FITONE_GPU_LANE_OUT=$W/lane timeout 430 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/gpu-lane.log 2>&1
echo "exit $?" >> $W/lane/gpu-lane.log
tar czf $OUT/ext.tgz -C /tmp ext 2>/dev/null
tar czf $OUT/call1.tgz -C $W .
left=$((555 - SECONDS))
if [ $left -gt 120 ]; then
  timeout -s KILL $left python3 -m fitone probe-batch --recipe llama-3.1-8b/24gb model=llama-3.1-8b from_scratch=true --json $W/probe/p.json --plot $W/probe/p.png > $W/probe/probe.log 2>&1
  echo "exit $? (limit $left s)" >> $W/probe/probe.log
fi
tar czf $OUT/call1.tgz -C $W .
