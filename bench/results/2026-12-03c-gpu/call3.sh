# issue 31's quality bar on t5-3b: from its config on the shipped sample task (numbers to words), bf16 training,
# micro-batch 32, 8/48 tokens, lr 3e-4 (30 warm-up steps, linear), seed 0, 300 steps, 23 GiB cap, the run with
# --optimizer-states bf16 alone on the machine (its speed counts: issue 31's speed bar), killed at 555 s (the
# metrics are written as it goes; the held-out score comes before the export)
source bench/results/2026-12-03-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W/t5-3b
MODEL=t5-3b PRECISION=bf16 RUNS="bf16" LIMIT=${LIMIT:-555} bash scripts/quality_gpu.sh $W/t5-3b 300 > $W/t5-3b/quality.log 2>&1
tar czf $OUT/call3.tgz -C $W .
