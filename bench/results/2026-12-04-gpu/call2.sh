# The exact mode against itself on gpt2-xl: call 1's exact run (the pipelined update) again through DeepSpeed's own
# step (--no-pipelined-update; --optimizer-states fp32 is the default), alone on the machine: the same seed, data
# and arithmetic, summed in another order. Its gap to call 1's exact run is the floor under any gap to the 16-bit
# states' run. Killed at LIMIT s.
source bench/results/2026-12-03-gpu/prelude.sh
W=/tmp/o2; mkdir -p $W/gpt2-xl
MODEL=gpt2-xl PRECISION=bf16 RUNS="deepspeed" LIMIT=${LIMIT:-560} \
  DATA="--data fitone/sample_data/numbers-train.jsonl --eval-data fitone/sample_data/numbers-eval.jsonl --prompt-field source --text-field target --seq-len 64" \
  bash scripts/quality_gpu.sh $W/gpt2-xl 300 > $W/gpt2-xl/quality.log 2>&1
tar czf $OUT/call2.tgz -C $W .
