#!/usr/bin/env bash
# Issue 8's training check on the GPU: do the overlapped updates train as well as the default?
# t5-large from scratch on the bundled sample task (numbers to words), fp16 with dynamic loss scaling,
# ZeRO-2 + CPU offload, 23 GiB cap, micro-batch 32, lr 3e-4 (30 warm-up steps, linear decay), 300 steps,
# the same seed: DeepSpeed's own step (--no-pipelined-update; fitone's default until the pipelined update
# passed this check) and --pipelined-update (RUNS="deepspeed pipelined delayed" adds --delayed-update after
# 20 plain steps; the first is the reference). The runs share the GPU and the
# host at once (speed is not measured here; each gets an equal share of the cores), then
# scripts/quality_table.py compares the curves. Run from the repo root on a CUDA
# machine; writes each run's log and metrics.jsonl under $1.
# Each run is killed after LIMIT seconds (default 560, under a 600 s limit on one command) so that what it
# logged still comes back; its metrics.jsonl is written as it goes, so a cut run still gives a partial curve.
# SIGKILL, not SIGTERM: on SIGTERM fitone writes a resumable checkpoint first (~20 s for t5-large), which
# this throwaway run does not need and the call's time cannot spare.
# On the H200 three runs at once took 1.57 (deepspeed), 1.15 (pipelined), 0.96 (delayed) s a step: the
# reference then needs ~600 s for 300 steps, more than that limit; hence two runs by default. Two at once:
# 1.43 and 1.11 s a step, and the reference needs ~560 s with its start, save and held-out score (on a
# fresh machine add ~90 s for the CPU Adam build): give it LIMIT=560 on a warm machine, or run it alone.
# Issue 31's check of the optimizer's host state: RUNS="exact bf16" PRECISION=bf16 (the 16-bit states need bf16
# training), exact = --optimizer-states fp32, bf16 = stochastic rounding (also bf16-nearest, bf16-kahan). A
# causal LM takes the sample task as prompt + completion: DATA="--data fitone/sample_data/numbers-train.jsonl
# --eval-data fitone/sample_data/numbers-eval.jsonl --prompt-field source --text-field target --seq-len 64".
# Dry run of the mechanics on a CPU: MODEL=t5-tiny PRECISION=fp32 EXTRA="--device cpu" scripts/quality_gpu.sh /tmp/q 40
set -uo pipefail
out=${1:?usage: quality_gpu.sh OUT_DIR [STEPS]}
steps=${2:-300}
model=${MODEL:-t5-large}
precision=${PRECISION:-fp16}
extra=${EXTRA:---max-gpu-memory 23GiB}
limit=${LIMIT:-560}
data=${DATA:---data sample --src-len 8 --tgt-len 48}
runs=(${RUNS:-deepspeed pipelined})  # the first is the reference; fewer runs get more cores each
mkdir -p "$out"
threads=$(( $(nproc) / ${#runs[@]} > 0 ? $(nproc) / ${#runs[@]} : 1 ))
common="--model $model --from-scratch $data --batch-size 32 --lr 3e-4 --lr-schedule linear --warmup-steps 30 --max-steps $steps --precision $precision $extra --eval-examples 200 --log-every 1 --no-progress --seed 0"
declare -A flags=([deepspeed]="--no-pipelined-update" [pipelined]="--pipelined-update" [delayed]="--delayed-update"
                   [exact]="--optimizer-states fp32" [bf16]="--optimizer-states bf16"
                   [bf16-nearest]="--optimizer-states bf16-nearest" [bf16-kahan]="--optimizer-states bf16-kahan")
for run in "${runs[@]}"; do
  [[ -v flags[$run] ]] || { echo "quality_gpu.sh: unknown run '$run' in RUNS: choose from ${!flags[*]}" >&2; exit 2; }
done
for run in "${runs[@]}"; do
  cmd="python3 -m fitone train $common ${flags[$run]} --out /tmp/quality-$run --overwrite"
  echo "\$ OMP_NUM_THREADS=$threads $cmd" > "$out/$run.log"
  ( SECONDS=0; OMP_NUM_THREADS=$threads timeout -s KILL "$limit" $cmd >> "$out/$run.log" 2>&1; echo "exit $? after ${SECONDS}s" >> "$out/$run.log"
    cp /tmp/quality-$run/metrics.jsonl "$out/$run-metrics.jsonl" 2>/dev/null ) &
done
wait
tail -n 4 "$out"/*.log
metrics=(); for run in "${runs[@]}"; do metrics+=("$out/$run-metrics.jsonl"); done
python3 scripts/quality_table.py "${metrics[@]}" | tee "$out/table.md"
