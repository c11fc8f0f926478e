# 2026-12-08 call 2 (NOTES 2026-12-08, bars 1 and 2 of issue 29): t5-3b (fp16, 128/128, 23 GiB cap but for the
# uncapped tool) at micro-batches 8 and 64, 2 warm-up + 8 timed steps, side by side in one run: stock DeepSpeed
# ZeRO-2 offload, fitone's defaults and plain PyTorch on the whole GPU. The ops from call 1's ext.tgz (.ext/).
source bench/results/2026-12-08-gpu/prelude.sh
W=/tmp/c2; mkdir -p $W/bench
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
left=$(( 585 - SECONDS ))
timeout -s KILL $left python3 scripts/bench_tools.py --tools deepspeed,fitone,torch-plain-uncapped --batch-sizes 8,64 --same-process --warmup 2 --steps 8 --out $W/bench/ --log-dir --budget $(( left - 12 )) > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s (limit $left s)" >> $W/bench/bench.log; tail -n 14 $W/bench/bench.log
tar czf $OUT/call2.tgz -C $W .
