# issue 31's quality bar on t5-3b, the exact mode: from its config (built on the GPU in bf16 since this session's
# from-scratch change; the start was ~145 s of CPU init before), the shipped sample task (numbers to words, 8/48
# tokens), bf16 training, micro-batch 32, lr 3e-4 (30 warm-up steps, linear), seed 0, 300 steps, 23 GiB cap,
# 200 held-out examples scored after the export; --optimizer-states fp32, the pipelined update, alone on the
# machine (16 threads), killed at LIMIT s. With the carried tree's sums.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/t5-3b
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
MODEL=t5-3b PRECISION=bf16 RUNS="exact" LIMIT=${LIMIT:-565} bash scripts/quality_gpu.sh $W/t5-3b 300 > $W/t5-3b/quality.log 2>&1
rm -rf /tmp/quality-exact; tar czf $OUT/call1.tgz -C $W .
