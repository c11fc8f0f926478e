# the plan beside probe-batch (the largest micro-batch, --prefer-batch largest: no timed accumulation trials) on
# llama-7b and Mistral-7B, each under its recipe (seq 512, bf16, 23 GiB cap, the model's own loss at 32k)
D=bench/results/2026-12-02e-gpu; source $D/prelude.sh
W=/tmp/o2
for m in llama-7b mistral-7b; do
  mkdir -p $W/$m; R="model=$m from_scratch=true data=synthetic"
  python3 -m fitone plan --recipe $m/24gb $R --json > $W/$m/plan.json 2> $W/$m/plan.err
  [ $m = llama-7b ] && left=270 || left=$((570 - SECONDS))
  timeout -s KILL $left python3 -m fitone probe-batch --recipe $m/24gb $R --prefer-batch largest --json $W/$m/p.json --plot $W/$m/p.png > $W/$m/probe.log 2>&1
  echo "exit $? (limit $left s)" >> $W/$m/probe.log
  tar czf $OUT/call2.tgz -C $W .
done
