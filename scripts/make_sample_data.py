"""Write fitone's shipped sample task: English words for the numbers 0-9999 (seq2seq).

Learnable and checkable (the answer is exact), compositional (held-out numbers need the rules, not
memory), and small. Run from the repo root: python scripts/make_sample_data.py
"""

import json
import random
from pathlib import Path

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + words(n % 100))
    return words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + words(n % 1000))


def main() -> None:
    numbers = list(range(10000))
    random.Random(0).shuffle(numbers)
    out = Path(__file__).resolve().parent.parent / "fitone" / "sample_data"
    out.mkdir(exist_ok=True)
    for name, part in (("numbers-eval.jsonl", numbers[:500]), ("numbers-train.jsonl", numbers[500:])):
        with open(out / name, "w") as f:
            for n in part:
                f.write(json.dumps({"source": str(n), "target": words(n)}) + "\n")


if __name__ == "__main__":
    main()
