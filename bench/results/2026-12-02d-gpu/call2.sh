# the plan beside probe-batch: Qwen3-8B with the chunked fused loss (no liger-kernel on the path), then
# Llama-3.1-8B with Liger's (liger-kernel on the path), each under its recipe (seq 512, bf16, 23 GiB cap)
D=bench/results/2026-12-02d-gpu; source $D/prelude.sh
W=/tmp/o2; mkdir -p $W/qwen3-8b $W/llama-3.1-8b
R="model=qwen3-8b from_scratch=true data=synthetic"
python3 -m fitone plan --recipe qwen3-8b/24gb $R --json > $W/qwen3-8b/plan.json 2> $W/qwen3-8b/plan.err
timeout -s KILL 280 python3 -m fitone probe-batch --recipe qwen3-8b/24gb $R --json $W/qwen3-8b/p.json --plot $W/qwen3-8b/p.png > $W/qwen3-8b/probe.log 2>&1
echo "exit $?" >> $W/qwen3-8b/probe.log
tar czf $OUT/call2.tgz -C $W .
export PYTHONPATH=/tmp/liger:$PYTHONPATH
R="model=llama-3.1-8b from_scratch=true data=synthetic"
python3 -m fitone plan --recipe llama-3.1-8b/24gb $R --json > $W/llama-3.1-8b/plan.json 2> $W/llama-3.1-8b/plan.err
left=$((575 - SECONDS))
timeout -s KILL $left python3 -m fitone probe-batch --recipe llama-3.1-8b/24gb $R --json $W/llama-3.1-8b/p.json --plot $W/llama-3.1-8b/p.png > $W/llama-3.1-8b/probe.log 2>&1
echo "exit $? (limit $left s)" >> $W/llama-3.1-8b/probe.log
tar czf $OUT/call2.tgz -C $W .
