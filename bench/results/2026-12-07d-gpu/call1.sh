# 2026-12-07d call 1 (NOTES 2026-12-07d): llama-7b's recipe as it ships (16 x 2 x 512, bf16, clip 1.0; random init
# clips every step), 23 GiB cap, synthetic tokens, 10 steps (the first 3 untimed), no export, in one call: the GPU
# Adam share at 0.4, 0.5 and 0.25, and the defaults. The ops from 2026-12-07c's ext.tgz, carried as .ext/ext.tgz.
source bench/results/2026-12-06-gpu/prelude.sh
W=/tmp/d1; mkdir -p $W
find fitone tests -type f \( -name "*.py" -o -name "*.cpp" -o -name "*.cu" -o -name "*.json" \) | LC_ALL=C sort | xargs sha256sum > $W/tree-sums.txt
for tag in share40 defaults share50 share25; do
  extra=$([ $tag = defaults ] || echo gpu_adam_share=0.${tag#share})
  left=$(( 585 - SECONDS )); [ $left -gt 110 ] || break
  OUT=$W timeout -s KILL $left python3 scripts/bench_train.py llama-7b-$tag --no-export -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true data=synthetic $extra max_steps=10 save_every=null eval_examples=0 out=/tmp/rl-$tag --overwrite --no-progress > $W/$tag.log 2>&1
  echo "exit $? (limit $left s, at $SECONDS s)" >> $W/$tag.log; tail -n 2 $W/$tag.log | cut -c1-300
  cp /tmp/rl-$tag/metrics.jsonl $W/$tag-metrics.jsonl 2>/dev/null; rm -rf /tmp/rl-$tag
done
echo "call took $SECONDS s"; tar czf $OUT/call1.tgz -C $W .
