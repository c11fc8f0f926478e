"""Write causal-LM text data with long-tailed lengths, for comparing `--pack` with padded batches.

Lengths (in words) follow a log-normal distribution: most examples are short, a few are long, as in
instruction and chat corpora. That is where padding to each batch's longest example wastes the most.
The text is random words from a small vocabulary: the point is the lengths, not the content.

    python scripts/make_longtail_data.py --out longtail.jsonl --examples 50000 --median-words 60 \
        --max-words 900
    fitone train --model gpt2-xl --data longtail.jsonl --seq-len 1024 --batch-size auto [--pack]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her this which or had are but not be "
         "have one all were they their there been has an when who will more if out so up said what about "
         "into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()


def lengths(n: int, median: float, sigma: float, longest: int, rng: random.Random) -> list[int]:
    """n log-normal lengths with the given median, at least 1 and at most `longest` words."""
    return [max(1, min(longest, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the .jsonl file to write (a 'text' field per line)")
    p.add_argument("--examples", type=int, default=50_000)
    p.add_argument("--median-words", type=float, default=60.0)
    p.add_argument("--sigma", type=float, default=1.0, help="spread of log-length (1.0: a long tail)")
    p.add_argument("--max-words", type=int, default=900, help="longest example (about --seq-len tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    sizes = lengths(args.examples, args.median_words, args.sigma, args.max_words, rng)
    out = Path(args.out)
    with open(out, "w", encoding="utf-8") as f:
        for n in sizes:
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")
    ordered = sorted(sizes)
    print(f"wrote {out}: {len(sizes)} examples, words per example: median {ordered[len(ordered) // 2]}, "
          f"p90 {ordered[int(len(ordered) * 0.9)]}, max {ordered[-1]}, mean {sum(sizes) / len(sizes):.1f}")


if __name__ == "__main__":
    main()
