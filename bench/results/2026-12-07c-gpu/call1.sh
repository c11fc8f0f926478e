# 2026-12-07c call 1 (NOTES 2026-12-07c): the ops (the GPU Adam's CUDA op with them) built and packed as ext.tgz;
# the host's room for link copies beside CPU Adam (scripts/bench_adam_beside_dma.py); the GPU Adam's GPU-lane tests;
# then llama-7b's recipe as it ships (clip 1.0; random-init llama clips every step), 16 x 2 x 512, bf16, 23 GiB cap,
# synthetic tokens, 10 steps (the first 3 untimed), no export: with gpu_adam_share=0.33, then the defaults.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > $W/build-cpu-adam.log 2>&1 &
python3 -c "from fitone.zero2 import adam32; print(adam32.available())" > $W/build-adam32.log 2>&1 &
python3 -c "from fitone.zero2.low_precision import fused_op; fused_op()" > $W/build-adam16.log 2>&1 &
python3 -c "from fitone.zero2 import cpu_adam; cpu_adam.load_op()" > $W/build-ds-adam.log 2>&1 &
python3 -c "from fitone.zero2 import gpu_adam; gpu_adam._op(); print('built')" > $W/build-adam-gpu.log 2>&1 &
wait; tar czf $OUT/ext.tgz -C /tmp ext; echo "ops after $SECONDS s"; tail -2 $W/build-adam-gpu.log
python3 scripts/bench_adam_beside_dma.py --json $W/dma.json > $W/dma.log 2>&1; cat $W/dma.log
FITONE_GPU_LANE_OUT=$W timeout -s KILL 200 python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_gpu_adam_gpu.py > $W/lane.log 2>&1
echo "exit $? after $SECONDS s" >> $W/lane.log; tail -8 $W/lane.log
for tag in share defaults; do
  extra=$([ $tag = share ] && echo gpu_adam_share=0.33)
  left=$(( 585 - SECONDS )); [ $left -gt 120 ] || break
  OUT=$W timeout -s KILL $left python3 scripts/bench_train.py llama-7b-$tag --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic $extra max_steps=10 save_every=null eval_examples=0 out=/tmp/rl-$tag --overwrite --no-progress > $W/$tag.log 2>&1
  echo "exit $? (limit $left s)" >> $W/$tag.log; tail -3 $W/$tag.log
  cp /tmp/rl-$tag/metrics.jsonl $W/$tag-metrics.jsonl 2>/dev/null
done
echo "call took $SECONDS s"; tar czf $OUT/call1.tgz -C $W .
