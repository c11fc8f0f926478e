# Issue 31's quality bar on t5-3b, the exact mode against itself: 2026-12-04b-gpu/call1's command again on the same
# tree (from its config, built on the GPU in bf16; the shipped sample task, 8/48 tokens; bf16 training, micro-batch
# 32, lr 3e-4, 30 warm-up steps, linear; seed 0, 300 steps, 23 GiB cap, 200 held-out examples after the export;
# --optimizer-states fp32, the pipelined update), alone on the machine, killed at LIMIT s.
source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W/t5-3b
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
MODEL=t5-3b PRECISION=bf16 RUNS="exact" LIMIT=${LIMIT:-570} bash scripts/quality_gpu.sh $W/t5-3b 300 > $W/t5-3b/quality.log 2>&1
rm -rf /tmp/quality-exact; tar czf $OUT/call3.tgz -C $W .
