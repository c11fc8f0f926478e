# llama-7b in the exact mode at the recipe's 16 x 2 x 512, 20 steps and the streamed export in ONE run (issue 27's
# last host number, bar <= 94 GiB), with beside it: the GPU lane (gpt2, a few GiB of host: it cannot tilt the
# llama's RSS, only its speed), the carried tree's per-file sums, and the rebuilt fused 16-bit op for the next calls
source bench/results/2026-12-03-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/llama-7b $W/lane
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | sort | xargs sha256sum > $W/tree-sums.txt
( OUT=$W/llama-7b timeout -s KILL 540 python3 scripts/bench_train.py llama-7b -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic max_steps=20 save_every=null eval_examples=0 out=/tmp/r7 --overwrite --no-progress > $W/llama-7b/run.log 2>&1
  echo "exit $?" >> $W/llama-7b/run.log; cp /tmp/r7/metrics.jsonl $W/llama-7b/ 2>/dev/null; ls -la /tmp/r7/final > $W/llama-7b/final-ls.txt 2>&1; rm -rf /tmp/r7 ) &
( python3 -c "from fitone.zero2.low_precision import fused_op; fused_op()" > $W/adam16-build.log 2>&1; echo "exit $?" >> $W/adam16-build.log ) &
( export PYTHONPATH=/tmp/liger:$PYTHONPATH; FITONE_GPU_LANE_OUT=$W/lane timeout -s KILL 540 python3 -m pytest -m gpu -v --durations=0 -p no:cacheprovider tests/gpu > $W/lane/gpu-lane.log 2>&1
  echo "exit $?" >> $W/lane/gpu-lane.log ) &
wait
tar czf $OUT/call1.tgz -C $W .
tar czf $OUT/ext.tgz -C /tmp ext
