# the carried tree's per-file sums (the lane's tree hash, call 6, differed from the local one), then t5-3b fp16 at 64,
# the pipelined update against --speculative-update, one after the other in one run (issue 29's prediction in
# bench/NOTES.md: ~3% at 64)
D=bench/results/2026-12-03-gpu; source $D/prelude.sh
W=/tmp/o7; mkdir -p $W/spec
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | sort | xargs sha256sum > $W/tree-sums.txt
timeout -s KILL 280 python3 scripts/bench_tools.py --tools fitone-pipelined,fitone-speculative --batch-sizes 64 --steps 6 --out $W/spec/ --log-dir --budget 270 > $W/spec/bench.log 2>&1
echo "exit $?" >> $W/spec/bench.log
tar czf $OUT/call7.tgz -C $W .
