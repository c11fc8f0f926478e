# Qwen3-8B at 2 x 3 (the chunked fused loss, no liger-kernel on the path) under torch's memory history: what is alive
# at the accumulating peak the plan misses (2026-12-02d-gpu: 19.90 GiB measured at 2 x 24, the plan 18.43); then
# the JIT builds, for the next calls
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
W=/tmp/o1; mkdir -p $W/qwen3-8b
OUT=$W/qwen3-8b timeout -s KILL 420 python3 scripts/gpu_memory_peak.py qwen3-8b-2x3 -- train --recipe qwen3-8b/24gb model=qwen3-8b from_scratch=true data=synthetic batch_size=2 global_batch=6 max_steps=2 save_every=null eval_examples=0 out=/tmp/rq --overwrite --no-progress > $W/qwen3-8b/run.log 2>&1
echo "exit $?" >> $W/qwen3-8b/run.log; rm -rf /tmp/rq
tar czf $OUT/call1.tgz -C $W .
tar czf $OUT/ext.tgz -C /tmp ext
