# Builds the ops (packed into $OUT/ext.tgz for the later calls), then t5-3b (fp16, 128/128, 23 GiB cap, micro-batches
# 8 and 64, 2 warm-up + 20 timed steps) with --speculative-update and with the defaults, one step more under
# torch.profiler each, per-step counters in the records; /proc/meminfo's AnonHugePages sampled every 2 s meanwhile;
# then the CPU Adam thread sweep with what time is left.
BUILD_OPS=1 source bench/results/2026-12-04b-gpu/prelude.sh
W=/tmp/o1; mkdir -p $W/bench $W/adam
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
{ cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; nproc; lscpu | grep -i "numa\|model name\|socket\|thread"; } > $W/host.txt 2>&1
( while true; do echo "$SECONDS $(grep AnonHugePages /proc/meminfo | awk '{print $2}') $(free -m | awk '/Mem/{print $3}')"; sleep 2; done ) > $W/thp.txt &
SAMPLER=$!
timeout -s KILL 420 python3 scripts/bench_tools.py --tools fitone-speculative,fitone --batch-sizes 8,64 --warmup 2 --steps 20 --split-steps 1 --profile --out $W/bench/ --log-dir --budget 410 > $W/bench/bench.log 2>&1
echo "exit $? after $SECONDS s" >> $W/bench/bench.log; tail -14 $W/bench/bench.log
kill $SAMPLER
tar czf $OUT/call1.tgz -C $W .
left=$(( 580 - SECONDS ))
[ $left -gt 40 ] && timeout -s KILL $left python3 scripts/bench_cpu_adam.py --elements 1073741824 --threads 4,8,12,15,16 --steps 3 > $W/adam/threads.txt 2>&1
echo "exit $? after $SECONDS s" >> $W/adam/threads.txt; cat $W/adam/threads.txt | tail -12
tar czf $OUT/call1.tgz -C $W .
