"""The CPU quick start's held-out scores, per group of ten seeds, and the 16-bit states against the exact mode's
runs pooled over the ways its arithmetic was run (DeepSpeed's step under AVX512 and AVX2, the pipelined update):
python bench/results/2026-12-04b-cpu-quickstart-exact-spread/pooled.py (from the repository root)."""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = {  # group name here -> (result.json, its group there)
    "exact, DeepSpeed's step, AVX512": ("../2026-12-04-cpu-quickstart-states10/result.json", "exact"),
    "exact, DeepSpeed's step, AVX2": ("deepspeed-avx2/result.json", "exact"),
    "exact, pipelined update, AVX512": ("pipelined/result.json", "exact-pipelined"),
    "bf16 (stochastic), pipelined update, AVX512": ("pipelined/result.json", "bf16"),
}
LEVELLED_OFF = 0.19  # a final training loss above this: the run levelled off (every other run ends at 0.11-0.17)


def runs(path: str, group: str) -> list[dict]:
    return [r for r in json.loads((HERE / path).read_text())["runs"] if r["group"] == group]


def line(name: str, rs: list[dict], score: str) -> str:
    xs = [r["quality"][score] for r in rs]
    stalled = [r["overrides"]["seed"] for r in rs if r["final_loss"] > LEVELLED_OFF]
    return (f"| {name} | {len(xs)} | {statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f} | [{min(xs):.4f}, "
            f"{max(xs):.4f}] | {len(stalled)} (seeds {', '.join(map(str, stalled)) or '-'}) |")


groups = {name: runs(*where) for name, where in SOURCES.items()}
pooled = [r for name, rs in groups.items() if name.startswith("exact") for r in rs]
for score in ("eval_loss", "token_accuracy"):
    print(f"\n{score}\n\n| group | runs | mean ± sd | [min, max] | levelled off (final loss > {LEVELLED_OFF}) |")
    print("|---|---|---|---|---|")
    for name, rs in groups.items():
        print(line(name, rs, score))
    print(line("**exact, all three pooled**", pooled, score))
    ref = [r["quality"][score] for r in pooled]
    mine = [r["quality"][score] for r in groups["bf16 (stochastic), pipelined update, AVX512"]]
    gap = statistics.mean(mine) - statistics.mean(ref)
    print(f"\nbf16 against the pooled exact runs: gap of means {gap:+.4f}, pooled sd {statistics.stdev(ref):.4f}: "
          f"{'within' if abs(gap) <= statistics.stdev(ref) else 'NOT within'}")
