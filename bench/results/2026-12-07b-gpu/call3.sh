# Bar 3 with llama-7b's recipe as it ships (grad_clip 1.0; a random-init llama-7b clips every step): --speculative-update,
# then the defaults (the pipelined update), each 16 x 2 x 512, bf16, 23 GiB cap, synthetic tokens, 10 steps (the first
# 3 untimed), no export. The ops from call 1's ext.tgz, carried as .ext/ext.tgz.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/o3; mkdir -p $W
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
for tag in speculative defaults; do
  extra=$([ $tag = speculative ] && echo speculative_update=true)
  left=$(( 585 - SECONDS )); [ $left -gt 120 ] || break
  OUT=$W timeout -s KILL $left python3 scripts/bench_train.py llama-7b-$tag --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic $extra max_steps=10 save_every=null eval_examples=0 out=/tmp/rl-$tag --overwrite --no-progress > $W/$tag.log 2>&1
  echo "exit $? (limit $left s)" >> $W/$tag.log; tail -3 $W/$tag.log
  cp /tmp/rl-$tag/metrics.jsonl $W/$tag-metrics.jsonl 2>/dev/null
done
echo "call took $SECONDS s"; tar czf $OUT/call3.tgz -C $W .
