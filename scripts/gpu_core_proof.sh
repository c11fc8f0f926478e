#!/usr/bin/env bash
# Issue 2's GPU proof: t5-3b from scratch, ZeRO-2 + CPU offload, 23 GiB cap (a 24 GB card), fp16 then bf16.
# Run on a CUDA machine from the repo root; writes logs and metrics under $1.
# The runs take fitone's default step, on one GPU the pipelined update; bench/results/2026-11-29-core/ was
# measured before that became the default: EXTRA=--no-pipelined-update reproduces it.
set -uo pipefail
out=${1:?usage: gpu_core_proof.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
for prec in fp16 bf16; do
  cmd="python3 -m fitone train --model t5-3b --from-scratch --data synthetic --src-len 128 --tgt-len 128 --batch-size 64 --max-gpu-memory 23GiB --max-steps 20 --precision $prec --no-progress ${EXTRA:-} --out /tmp/run-$prec"
  echo "\$ $cmd" | tee "$out/core-$prec.log"
  SECONDS=0; $cmd >> "$out/core-$prec.log" 2>&1
  echo "exit $? after ${SECONDS}s" >> "$out/core-$prec.log"
  cp /tmp/run-$prec/metrics.jsonl "$out/core-$prec-metrics.jsonl" 2>/dev/null
  grep -E "TrainResult|error|exit" "$out/core-$prec.log"
  rm -rf /tmp/run-$prec
done
