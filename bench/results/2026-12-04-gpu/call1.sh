# issue 31's quality bar on gpt2-xl, the whole 300 steps this time: from its config, the shipped sample task as
# prompt + completion (seq 64), bf16 training, micro-batch 32, lr 3e-4 (30 warm-up steps, linear), seed 0, 300
# steps, 23 GiB cap; --optimizer-states fp32 (exact) and bf16 (stochastic rounding) at once, 8 threads each, each
# killed at LIMIT s. First DeepSpeed's CPU Adam and
# fitone's two ops are built (outside the runs' limit); they come back as ext.tgz for the next calls.
source bench/results/2026-12-03-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/gpt2-xl
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
SECONDS=0
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > $W/build-cpu-adam.log 2>&1 &
python3 -c "from fitone.zero2 import adam32; print(adam32.available())" > $W/build-adam32.log 2>&1 &
python3 -c "from fitone.zero2.low_precision import fused_op; fused_op()" > $W/build-adam16.log 2>&1 &
wait; echo "builds ${SECONDS}s" > $W/builds.txt
tar czf $OUT/ext.tgz -C /tmp ext
MODEL=gpt2-xl PRECISION=bf16 RUNS="exact bf16" LIMIT=${LIMIT:-480} \
  DATA="--data fitone/sample_data/numbers-train.jsonl --eval-data fitone/sample_data/numbers-eval.jsonl --prompt-field source --text-field target --seq-len 64" \
  bash scripts/quality_gpu.sh $W/gpt2-xl 300 > $W/gpt2-xl/quality.log 2>&1
tar czf $OUT/call1.tgz -C $W .
