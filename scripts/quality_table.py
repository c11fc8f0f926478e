"""Compare training runs' loss curves against the first one (issue 8's "trains as well" check).

    python scripts/quality_table.py default/metrics.jsonl pipelined/metrics.jsonl delayed/metrics.jsonl \\
        [--png curves.png]

Each argument is a `fitone train` metrics.jsonl (or its run directory) logged with --log-every 1; the
first is the reference. Prints a markdown table: steps, NaN/inf losses, skipped steps (fp16 loss-scale
search), mean loss over the last 50 steps that every run reached and its gap to the reference, the
largest gap between WINDOW-step means after the warm-up (signed: negative is a lower loss than the
reference's), and the held-out quality numbers with the eval_loss gap. Draws the curves (10-step means)
to a PNG next to the first file (or --png). The tolerance stated with the table is TOLERANCE, both ways:
a run passes when its last-50 mean, every WINDOW-step mean after the warm-up and its held-out eval_loss
stay within it (relative to the reference's), it has no NaN step, and it skipped no more steps than the
reference plus 2. A run cut short is compared on the steps all runs share; where either side has no final
held-out eval_loss the verdict is "curve only" (the run's curve passes, its final quality number could not
be compared).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import _harness  # noqa: F401 - the checkout's fitone first on the path

TOLERANCE = 0.05  # relative, on WINDOW-step, last-50-step and held-out losses
SETTLE = 30  # the first steps (warm-up, loss-scale search) are not held to the tolerance
# 50, not 10: two runs of the same arithmetic in a different order (DeepSpeed's Adam kernel against
# PyTorch's, 300 steps on the CPU) drift apart by up to 13% in 10-step means but at most 4% in 50-step
# means, while a real change (the delayed update) is 18-385% off in either (bench/NOTES.md, 2026-11-29).
WINDOW = 50


def load(path: str) -> tuple[dict[int, float], int, dict[str, float]]:
    from fitone.report import read_run

    records = read_run(path)
    losses = {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}
    skipped = max((int(r.get("skipped_steps") or 0) for r in records), default=0)
    # the final held-out score only: a run cut short (or scored mid-run with --eval-every) has none at
    # its last step, and an earlier score is not comparable with another run's final one
    last = max(losses, default=0)
    quality = next((r for r in reversed(records) if "eval_loss" in r and int(r["step"]) >= last), {})
    return losses, skipped, {k: v for k, v in quality.items() if k != "step"}


def run_name(path: str) -> str:
    """'pipelined' for pipelined-metrics.jsonl (scripts/quality_gpu.sh's names), else the run directory."""
    p = Path(path)
    if p.is_file():
        return p.name.replace("-metrics.jsonl", "") if p.name != "metrics.jsonl" else p.parent.name
    return p.name


def window_means(losses: dict[int, float], width: int = 10, start: int = 0) -> dict[int, float]:
    """Mean of each full window of `width` steps from step start+1 on (finite losses only), keyed by the
    window's last step."""
    out = {}
    for end in range(start + width, max(losses) + 1, width):
        vals = [losses[s] for s in range(end - width + 1, end + 1) if s in losses and math.isfinite(losses[s])]
        if vals:
            out[end] = statistics.fmean(vals)
    return out


def compare(paths: list[str], runs: list[tuple[dict[int, float], int, dict[str, float]]]) -> tuple[str, bool]:
    """The table and whether every run passes; `runs` are `load` of each path, the first the reference."""
    names = [run_name(p) for p in paths]
    ref_losses, ref_skipped, ref_quality = runs[0]
    ref_windows = window_means(ref_losses, WINDOW, SETTLE)
    common = min(max(losses) for losses, _, _ in runs)  # a run cut short: compare where all runs have steps
    tail = range(max(1, common - 49), common + 1)

    def tail_mean(losses: dict[int, float]) -> float:
        return statistics.fmean([losses[s] for s in tail if s in losses and math.isfinite(losses[s])])

    ref_last = tail_mean(ref_losses)
    rows, all_pass = [], True
    for name, (losses, skipped, quality) in zip(names, runs):
        nan = sum(not math.isfinite(v) for v in losses.values())
        last = tail_mean(losses)
        windows = window_means(losses, WINDOW, SETTLE)
        gaps = [((windows[e] - ref_windows[e]) / ref_windows[e], e) for e in windows if e in ref_windows]
        worst, at = max(gaps, key=lambda g: abs(g[0])) if gaps else (0.0, 0)
        curve_ok = nan == 0 and abs(last - ref_last) / ref_last <= TOLERANCE and abs(worst) <= TOLERANCE \
            and skipped <= ref_skipped + 2
        q = ", ".join(f"{k} {v:.3f}" for k, v in quality.items()) or "–"
        if "eval_loss" in quality and "eval_loss" in ref_quality:
            eval_gap = (quality["eval_loss"] - ref_quality["eval_loss"]) / ref_quality["eval_loss"]
            q += f" ({100 * eval_gap:+.1f}%)"
            verdict = "yes" if curve_ok and abs(eval_gap) <= TOLERANCE else "NO"
        else:
            verdict = "curve only" if curve_ok else "NO"
        all_pass &= verdict == "yes"
        rows.append(f"| {name} | {len(losses)} | {nan} | {skipped} | {last:.4f} "
                    f"| {100 * (last - ref_last) / ref_last:+.1f}% "
                    f"| {f'{100 * worst:+.1f}% (steps {at - WINDOW + 1}-{at})' if gaps else '–'} | {q} | {verdict} |")
    head = [f"| run | steps | NaN/inf losses | skipped steps | mean loss, steps {tail[0]}-{tail[-1]} | vs first "
            f"| largest {WINDOW}-step-mean gap after step {SETTLE} | held-out quality (eval_loss vs first) "
            f"| within {100 * TOLERANCE:.0f}% |",
            "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows), all_pass


def plot(paths: list[str], runs: list[tuple[dict[int, float], int, dict[str, float]]], png: Path) -> Path:
    from fitone.render import figure, save

    fig, (ax,) = figure()
    for p, (losses, _, _) in zip(paths, runs):
        means = window_means(losses)
        ax.plot(list(means), list(means.values()), label=run_name(p))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_yscale("log")
    ax.legend()
    return save(fig, png, integer_x=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files or run directories; the first is the reference")
    ap.add_argument("--png", type=Path, help="where to draw the curves (default: curves.png next to the first)")
    args = ap.parse_args(argv)
    runs = [load(p) for p in args.metrics]
    table, ok = compare(args.metrics, runs)
    print(table)
    first = Path(args.metrics[0])
    png = args.png or (first.parent if first.is_file() else first) / "curves.png"
    print(f"wrote {plot(args.metrics, runs, png)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
