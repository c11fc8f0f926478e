"""Every table and PNG fitone draws: plans, probe results, run reports. The numbers come from elsewhere.

The results are data and know nothing of drawing; this module takes them and imports none of them at run time
(their types only for the type checker), so it sits below every module whose results it draws.

Figures are drawn on `matplotlib.figure.Figure` with the Agg canvas, never through pyplot, so a
notebook's own backend and open figures are left alone. matplotlib is imported only when drawing.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from fitone.units import count_text, gib

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fitone.plan import Plan
    from fitone.probe.results import ProbeResult

DPI = 110


# -- figures ---------------------------------------------------------------------------------------
def figure(width: float = 8, height: float = 4.5, rows: int = 1, cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A bare figure and its axes, row by row; the rows of one column share their x axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, 1)]
    axes += [fig.add_subplot(rows, cols, i + 1, sharex=axes[0] if cols == 1 else None) for i in range(1, rows * cols)]
    return fig, axes


def save(fig: Figure, path: str | Path, *, integer_x: bool = False) -> Path:
    """Write `fig` as a PNG at `path` (folders made as needed). integer_x: whole-number ticks (steps)."""
    if integer_x:
        from matplotlib.ticker import MaxNLocator

        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# -- numbers in tables -----------------------------------------------------------------------------
def number(value: float | None, digits: int) -> str:
    """`value` to `digits` decimals; '-' when there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


# -- plans -----------------------------------------------------------------------------------------
def plan_text(p: Plan) -> str:
    """The table `fitone plan` prints: each component in GiB, the totals against the limits, the advice."""
    mode = "ZeRO-2 + CPU offload" if p.offload else "ZeRO-2, no offload"
    lens = " / ".join(f"{k} {v}" for k, v in p.lengths.items())
    lines = [
        f"{p.model}: {count_text(p.n_params)} params ({p.family} formula), {p.precision}, {mode}, "
        f"{p.gpus} GPU{'s' if p.gpus > 1 else ''}" + (f" on each of {p.nodes} nodes" if p.nodes > 1 else ""),
        f"micro-batch {p.micro_batch}, {lens}, activation checkpointing "
        f"{'on' if p.activation_checkpointing else 'off'}",
        "",
    ]
    width = max(len(c.name) for c in p.gpu + p.host) + 2
    ranks = f"x{p.gpus} ranks" + (" of one node" if p.nodes > 1 else "")
    host = f", per rank ({ranks} in the total)" if p.gpus > 1 else ", one node's" if p.nodes > 1 else ""
    for title, items, total, limit, limit_name in (
        ("GPU, per rank", p.gpu, p.gpu_total, p.gpu_limit, p.gpu_limit_source),
        ("host" + host, p.host, p.host_total, p.host_available, "available"),
    ):
        lines.append(f"{title:<{width}}{'GiB':>8}")
        lines += [f"  {c.name:<{width - 2}}{gib(c.bytes, 3):>8.2f}   {c.note}".rstrip() for c in items]
        of = "" if limit is None else f" of {gib(limit, 3):.2f} ({limit_name})"
        lines += [f"  {'total':<{width - 2}}{gib(total, 3):>8.2f}{of}", ""]
    if p.gpu_init:
        init = ", ".join(f"{c.name} {gib(c.bytes, 3):.2f}" for c in p.gpu_init)
        lines += [f"GPU at the engine's init: {gib(p.gpu_init_total, 3):.2f} GiB ({init})",
                  f"GPU peak: the {p.gpu_peak_phase}'s, {gib(p.gpu_peak, 3):.2f} GiB",
                  f"host while exporting final/: {gib(p.host_export, 3):.2f} GiB (one shard beside the steps')", ""]
    act = (f"activations per sample: {p.activation_per_sample_ckpt / 2**20:.1f} MiB with checkpointing, "
           f"{p.activation_per_sample_no_ckpt / 2**20:.1f} MiB without")
    lines.append(act)
    if p.max_micro_batch is not None:
        one = p.max_micro_batch_one_step  # accumulating holds more: the two differ where the run accumulates
        lines.append(f"largest micro-batch that fits: {p.max_micro_batch} ("
                     + (f"{one} at one micro-batch a step; " if one not in (None, p.max_micro_batch) else "")
                     + f"without offload: {p.max_micro_batch_without_offload})")
    lines.append(f"without offload: GPU {gib(p.gpu_total_without_offload, 3):.2f} GiB, "
                 f"host {gib(p.host_total_without_offload, 3):.2f} GiB")
    lines.append(f"one checkpoint (--save-every): {gib(p.checkpoint_bytes, 3):.2f} GiB of disk; --keep-checkpoints K "
                 "needs room for K + 1")
    if p.deepspeed_estimate:
        ds = p.deepspeed_estimate
        lines.append(f"DeepSpeed's own estimate (model states only): GPU {gib(ds['gpu'], 3):.2f} GiB, "
                     f"host {gib(ds['host'], 3):.2f} GiB")
    lines += ["", f"verdict: {p.verdict}"]
    lines += [f"  short of {k} memory by {gib(v, 3):.2f} GiB" for k, v in p.short.items()]
    if p.suggestions:
        lines += ["what would help:"] + [f"  - {s}" for s in p.suggestions]
    if p.notes:
        lines += ["notes:"] + [f"  - {n}" for n in p.notes]
    return "\n".join(lines)


def plot_plan(p: Plan, path: str | Path) -> Path:
    """Stacked bars of where memory goes on the GPU and the host, with the limit drawn in."""
    colors = dict(zip(p.by_category("gpu"),  # the plan's categories, in its order
                      ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
    fig, axes = figure(width=9, height=5.5, cols=2)
    panels = (("GPU (per rank)", "gpu", p.gpu_total, p.gpu_limit, "limit"),
              ("host" + (f" ({p.gpus} ranks)" if p.gpus > 1 else "") + (" of a node" if p.nodes > 1 else ""),
               "host", p.host_total, p.host_available, "available"))
    for ax, (title, where, total, limit, limit_name) in zip(axes, panels):
        scale = p.gpus if where == "host" else 1
        top = max(gib(total, 3), gib(limit, 3) if limit else 0.0)
        bottom = 0.0
        for cat, value in p.by_category(where).items():
            gib_value = gib(value * scale, 3)
            ax.bar([0], [gib_value], bottom=bottom, color=colors[cat], width=0.5, label=cat)
            if gib_value > 0.05 * top:  # small slices are left to the legend
                ax.text(0, bottom + gib_value / 2, f"{cat} {gib_value:.1f}", ha="center", va="center",
                        fontsize=8, color="white")
            bottom += gib_value
        if limit:
            ax.axhline(gib(limit, 3), color="black", linestyle="--", linewidth=1.2)
            ax.text(-0.58, gib(limit, 3), f"{limit_name} {gib(limit, 3):.1f} GiB", va="bottom", ha="left",
                    fontsize=8)
        ax.set_xlim(-0.6, 0.6)
        ax.set_ylim(0, top * 1.12 or 1)
        ax.set_xticks([0], [f"total {gib(total, 3):.1f} GiB"])
        ax.set_ylabel("GiB")
        ax.set_title(title)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, title="category")
    fig.suptitle(f"{p.model}, {p.precision}, micro-batch {p.micro_batch}: {p.verdict}", fontsize=10)
    return save(fig, path)


# -- probe results ---------------------------------------------------------------------------------
def probe_table(r: ProbeResult) -> str:
    """Fixed-width table of the trials in the order tried, then the answer."""
    # the batch column: micro-batch, or micro-batch x accumulation for a throughput candidate
    rows = [f"{'batch':>9}  {'result':<16} {'peak GPU GiB':>12} {'step s':>8} {'samples/s':>10}"]
    for t in r.trials:
        result = "fits" if t.fits else "OOM" + (f" ({t.oom_phase})" if t.oom_phase else "")
        if t.purpose in ("verify", "throughput", "check"):
            result += " " + {"verify": "verify", "throughput": "timed", "check": "check"}[t.purpose]
        peak = gib(t.peak_gpu_bytes) if t.peak_gpu_bytes is not None else None
        rows.append(f"{t.label:>9}  {result:<16} {number(peak, 2):>12} {number(t.step_s, 2):>8} "
                    f"{number(t.samples_per_s, 1):>10}")
    oom = f" ({r.smallest_oom} ran out of memory)" if r.smallest_oom is not None else ""
    rows.append(f"largest fit: {r.largest_fit}{oom}, granularity {r.granularity}")
    check = "verified" if r.verified else "NOT verified"
    cap = f", cap {gib(r.cap_bytes):.1f} GiB" if r.cap_bytes is not None else ""
    rows.append(f"chosen: {r.chosen} ({percent(r.margin)} margin, {check}{cap})")
    best = r.best_trial()
    if best is not None:
        rows.append(f"best throughput: {best.batch_size} ({best.samples_per_s:.1f} samples/s)")
    if r.micro_batch is not None:
        rows.append(probe_choice_line(r))
    return "\n".join(rows)


def probe_choice_line(r: ProbeResult) -> str:
    """'train with: micro-batch 32 x 3 accumulation steps (for --global-batch 96: the most samples/s of 3 timed
    within the margin; --prefer-batch throughput)'."""
    per_step = f"for --global-batch {r.global_batch}: " if r.global_batch is not None else ""
    return (f"train with: micro-batch {r.micro_batch} x {r.accumulation} accumulation "
            f"step{'s' if r.accumulation != 1 else ''} ({per_step}{choice_reason(r)}; --prefer-batch {r.prefer})")


def choice_reason(r: ProbeResult) -> str:
    """Why the probe's micro-batch x accumulation: 'the most samples/s of 3 timed within the margin', ..."""
    timed = r.candidates()
    if r.prefer == "throughput" and timed:
        return f"the most samples/s of {len(timed)} timed within the margin"
    return "the largest within the margin" + (" that divides it" if r.global_batch is not None else "")


def plot_probe(r: ProbeResult, path: str | Path) -> Path:
    """PNG of peak GPU memory and samples/s against batch size, with OOMs, the cap and the choice."""
    from matplotlib.ticker import FuncFormatter

    latest = {t.batch_size: t for t in r.trials if t.fits and t.accumulation == 1}  # verified: its longer run wins
    fits = [latest[s] for s in sorted(latest)]
    ooms = sorted((t for t in r.trials if not t.fits), key=lambda t: t.batch_size)
    measured = [t for t in fits if t.peak_gpu_bytes is not None]
    peaks = [gib(t.peak_gpu_bytes) for t in measured]
    top = max(peaks + ([gib(r.cap_bytes)] if r.cap_bytes else []) + [1.0])

    fig, (ax,) = figure(width=9, height=5.5)
    speed_ax = ax.twinx()
    handles = []
    if measured:
        handles += ax.plot([t.batch_size for t in measured], peaks, "o-", color="tab:blue",
                           label="peak GPU memory (GiB)")
    line = r.memory_line()
    if line is not None and fits:
        # many points: a straight line in memory vs size is a curve on the log2 axis
        low, high = min(t.batch_size for t in r.trials), max(t.batch_size for t in r.trials)
        xs = [low * (high / low) ** (i / 63) for i in range(64)]
        handles += ax.plot(xs, [gib(line[0] + line[1] * x) for x in xs], ":", color="tab:blue", alpha=0.6,
                           label=f"line fit: {gib(line[0]):.2f} GiB + {line[1] / 2**20:.1f} MiB/sample")
    timed = [t for t in fits if t.samples_per_s is not None and t.accumulation == 1]
    if timed:
        handles += speed_ax.plot([t.batch_size for t in timed], [t.samples_per_s for t in timed], "s--",
                                 color="tab:green", label="throughput (samples/s)")
    timed_pairs = [t for t in r.candidates() if t.fits and t.samples_per_s is not None]
    if timed_pairs:
        handles.append(speed_ax.scatter([t.batch_size for t in timed_pairs], [t.samples_per_s for t in timed_pairs],
                                        marker="*", s=140, color="tab:olive", zorder=6,
                                        label="timed for the choice (micro-batch x accumulation)"))
        for t in timed_pairs:
            speed_ax.annotate(t.label, (t.batch_size, t.samples_per_s), textcoords="offset points", xytext=(6, -10),
                              fontsize=8, color="tab:olive")
    if ooms:
        oom_y = gib(r.cap_bytes) if r.cap_bytes else top
        phases = sorted({t.oom_phase for t in ooms if t.oom_phase})
        handles.append(ax.scatter([t.batch_size for t in ooms], [oom_y] * len(ooms), marker="X", s=90,
                                  color="tab:red", zorder=5,
                                  label="out of memory" + (f" (in {', '.join(phases)})" if phases else "")))
        for t in ooms:
            ax.annotate(str(t.batch_size), (t.batch_size, oom_y), textcoords="offset points", xytext=(0, 8),
                        ha="center", va="bottom", rotation=90, fontsize=8, color="tab:red")
    if r.cap_bytes:
        cap_gib = gib(r.cap_bytes)
        handles.append(ax.axhline(cap_gib, color="tab:red", linestyle="--", linewidth=1,
                                  label=f"GPU memory cap {cap_gib:.1f} GiB"))
        ax.annotate(f"cap {cap_gib:.1f} GiB", (0.5, cap_gib), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=9, color="tab:red")
    handles.append(ax.axvline(r.chosen, color="gray", linestyle="-.", linewidth=1,
                              label=f"chosen {r.chosen} ({percent(r.margin)} margin)"))
    if r.micro_batch is not None and r.micro_batch != r.chosen:
        handles.append(ax.axvline(r.micro_batch, color="tab:green", linestyle="-.", linewidth=1,
                                  label=f"train with {r.micro_batch} x {r.accumulation} (--prefer-batch {r.prefer})"))

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel("micro-batch size (samples, log2 scale)")
    ax.set_ylabel("peak GPU memory (GiB)", color="tab:blue")
    speed_ax.set_ylabel("throughput (samples/s)", color="tab:green")
    ax.set_ylim(0, top * 1.2)  # room above the cap for the OOM labels
    speed_ax.set_ylim(bottom=0)
    what = " ".join(str(r.meta[k]) for k in ("model", "precision") if r.meta.get(k))
    ax.set_title(f"fitone probe-batch{': ' + what if what else ''} - largest fit {r.largest_fit}, "
                 f"chosen {r.chosen}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    return save(fig, path)


# -- a run's figures (fitone report, TrainResult.plot) -------------------------------------------------
# eval numbers a record may carry (an evaluation record: step + these); drawn as points on the loss figure
EVAL_KEYS = ("eval_loss", "exact_match")


def plot_run_loss(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, (ax,) = figure()
    pts = [(r["step"], r["loss"]) for r in records if finite(r.get("loss"))]
    bad = [r["step"] for r in records if "loss" in r and not finite(r["loss"])]
    steps, values = [s for s, _ in pts], [v for _, v in pts]
    handles = []
    if pts:
        # NaN where a loss was not finite, so the line breaks there instead of bridging the gap
        drawn = [(r["step"], r["loss"] if finite(r["loss"]) else math.nan) for r in records if "loss" in r]
        handles += ax.plot([s for s, _ in drawn], [v for _, v in drawn], color="tab:blue", linewidth=1,
                           alpha=0.45 if len(pts) >= 50 else 1, marker="o" if len(pts) < 30 else None,
                           markersize=3, label="training loss")
        if len(pts) >= 50:  # per-step losses are noisy; a centred moving average shows the trend without lag
            h = max(2, len(pts) // 50)
            smooth = [statistics.fmean(values[max(0, i - h):i + h + 1]) for i in range(len(values))]
            handles += ax.plot(steps, smooth, color="tab:blue", linewidth=2,
                               label=f"moving average ({2 * h + 1} logged steps)")
        positive = [v for v in values if v > 0]
        if positive and len(positive) == len(values) and max(positive) / min(positive) > 20:
            ax.set_yscale("log")
    skipped = _skipped_steps(records)
    if skipped:  # fp16 loss scaling threw the update away: the loss was computed, the weights did not move
        handles.append(ax.scatter([s for s, _ in skipped], [v for _, v in skipped], marker="v", s=40,
                                  color="tab:orange", zorder=4,
                                  label=f"update skipped (fp16 overflow), {len(skipped)} step"
                                        f"{'s' if len(skipped) != 1 else ''}"))
    if bad:
        y = min(values) if values else 1.0
        handles.append(ax.scatter(bad, [y] * len(bad), marker="x", color="tab:red", zorder=5,
                                  label=f"NaN/inf loss ({len(bad)} step{'s' if len(bad) != 1 else ''})"))
    evals = [(k, [(r["step"], r[k]) for r in records if finite(r.get(k))]) for k in EVAL_KEYS]
    evals = [(k, p) for k, p in evals if p]
    if evals:
        eval_ax = ax.twinx() if any(k != "eval_loss" for k, _ in evals) else None
        for (key, p), color in zip(evals, ("tab:purple", "tab:green")):
            target = ax if key == "eval_loss" else eval_ax
            handles += target.plot([s for s, _ in p], [v for _, v in p], "D--", color=color, markersize=5,
                                   label=key.replace("_", " ") + (" (right axis)" if target is not ax else ""))
        if eval_ax is not None:
            eval_ax.set_ylabel("exact match (fraction of held-out examples)")
            eval_ax.set_ylim(0, 1.05)
    scale = " (log scale)" if ax.get_yscale() == "log" else ""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss (mean cross-entropy per token){scale}")
    ax.set_title(f"{title}: loss")
    ax.grid(True, alpha=0.3)
    if evals:  # two y axes: keep the legend clear of both sets of lines
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
    else:
        ax.legend(handles=handles, loc="upper right", fontsize=8)
    return save(fig, path, integer_x=True)


def plot_run_throughput(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, (ax,) = figure()
    pts = [(r["step"], r["samples_per_s"]) for r in records if finite(r.get("samples_per_s"))]
    if pts:
        ax.plot([s for s, _ in pts], [v for _, v in pts], color="tab:green", linewidth=1,
                marker="o" if len(pts) < 30 else None, markersize=3, label="samples/s at this step")
        steady = [v for s, v in pts if s > 1] or [v for _, v in pts]
        med = statistics.median(steady)
        ax.axhline(med, color="gray", linestyle="--", linewidth=1, label=f"median {med:.1f} samples/s")
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no samples/s in metrics.jsonl", transform=ax.transAxes, ha="center")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{title}: throughput")
    ax.grid(True, alpha=0.3)
    return save(fig, path, integer_x=True)


def plot_run_memory(records: Sequence[dict[str, Any]], path: Path, title: str, cap_gib: float | None,
                 on_cpu: bool) -> Path:
    fig, (gpu_ax, host_ax) = figure(height=6.5, rows=2)
    panels = ((gpu_ax, "gpu_peak_gib", "GPU: peak memory allocated (torch.cuda.max_memory_allocated)",
               "peak allocated (GiB)", "tab:purple"),
              (host_ax, "host_rss_gib", "host: resident memory of the process (RSS)", "RSS (GiB)", "tab:brown"))
    for ax, key, label, unit, color in panels:
        pts = [(r["step"], r[key]) for r in records if finite(r.get(key))]
        if pts and not (ax is gpu_ax and on_cpu):
            ax.plot([s for s, _ in pts], [v for _, v in pts], color=color, marker="o" if len(pts) < 30 else None,
                    markersize=3)
            label += f", peak {max(v for _, v in pts):.2f} GiB"
        top = max([v for _, v in pts] + [0.0])
        if ax is gpu_ax and cap_gib:
            ax.axhline(cap_gib, color="tab:red", linestyle="--", linewidth=1, label=f"cap {cap_gib:.1f} GiB")
            top = max(top, cap_gib)
        if ax is gpu_ax and (on_cpu or not top):
            ax.text(0.5, 0.5, "CPU run: no GPU memory used" if on_cpu else "no GPU memory recorded",
                    transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_ylim(0, top * 1.15 or 1)
        ax.set_ylabel(unit)
        ax.set_title(label, fontsize=10)
        ax.grid(True, alpha=0.3)
        if cap_gib and ax is gpu_ax:
            ax.legend(loc="lower right", fontsize=8)
    host_ax.set_xlabel("optimizer step")
    fig.suptitle(f"{title}: memory")
    return save(fig, path, integer_x=True)


def _skipped_steps(records: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) of the steps whose update was skipped: where DeepSpeed's running count went up."""
    out, before = [], 0
    for r in records:
        count = r.get("skipped_steps")
        if finite(count):
            if count > before and finite(r.get("loss")):
                out.append((r["step"], r["loss"]))
            before = count
    return out


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
