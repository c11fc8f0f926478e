# probe-batch on Llama-3.1-8B's recipe (random tokens), with the plan made first
D=bench/results/2026-12-02c-gpu; rm -rf /tmp/site; source $D/prelude.sh
W=/tmp/o2; mkdir -p $W/probe
python3 -m fitone plan --recipe llama-3.1-8b/24gb model=llama-3.1-8b from_scratch=true data=synthetic --json > $W/probe/plan.json 2> $W/probe/plan.err
timeout -s KILL 380 python3 -m fitone probe-batch --recipe llama-3.1-8b/24gb model=llama-3.1-8b from_scratch=true data=synthetic --json $W/probe/p.json --plot $W/probe/p.png > $W/probe/probe.log 2>&1
echo "exit $?" >> $W/probe/probe.log
tar czf $OUT/call2.tgz -C $W .
