#!/usr/bin/env bash
# Issue 9's GPU proof: t5-3b from scratch, ZeRO-2 + CPU offload, 23 GiB cap per GPU, micro-batch 64 per GPU,
# one GPU then two GPUs under torchrun on the same machine. Samplers record every GPU's memory (nvidia-smi)
# and the machine's used host RAM (free) once a second, since only rank 0 writes metrics.
# Run on a machine with two GPUs from the repo root; writes under $1.
set -uo pipefail
out=${1:?usage: gpu_multi_proof.sh OUT_DIR}
mkdir -p "$out"
# NVLink multicast stays off (the machine this was measured on could not use it): set for every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nproc; free -g; } > "$out/machine.txt"
# The machine's RAM grows on demand (MemTotal reads ~31 GiB at start), so psutil's available RAM is not a
# budget here: the pre-flight and the host watch are turned off for these runs only.
common="--model t5-3b --from-scratch --data synthetic --src-len 128 --tgt-len 128 --batch-size 64 \
--max-gpu-memory 23GiB --max-steps 20 --precision ${PREC:-fp16} --no-progress --no-preflight --host-mem-warn 1 --host-mem-stop 1"
run() {
  name=$1; shift
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 1000 > "$out/$name-gpu.csv" &
  smi=$!
  ( while sleep 1; do echo "$(date +%s) $(free -b | awk '/Mem:/{print $3}')"; done ) > "$out/$name-host.txt" &
  hostw=$!
  echo "\$ $*" | tee "$out/$name.log"
  SECONDS=0; "$@" >> "$out/$name.log" 2>&1
  echo "exit $? after ${SECONDS}s" >> "$out/$name.log"
  kill $smi $hostw 2>/dev/null
  cp /tmp/run-$name/metrics.jsonl "$out/$name-metrics.jsonl" 2>/dev/null
  grep -E "TrainResult|rror|exit|OMP" "$out/$name.log" | tail -5
  rm -rf /tmp/run-$name
}
# the one-GPU run takes the ranks' step (several ranks keep DeepSpeed's; one GPU's default is the pipelined
# update), so the comparison measures the data parallelism alone
run 1gpu env CUDA_VISIBLE_DEVICES=0 python3 -m fitone train $common --no-pipelined-update --out /tmp/run-1gpu
run 2gpu torchrun --nproc_per_node 2 -m fitone train $common --out /tmp/run-2gpu
