"""Pictures and a summary of a run, from its `metrics.jsonl`: what `fitone report RUN_DIR` writes.

Figures are drawn and saved by fitone.render (no pyplot: a notebook's own backend is left alone).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fitone.errors import ConfigError, DataError
from fitone.metrics import read_metrics
from fitone.render import EVAL_KEYS
from fitone.render import finite as _finite
from fitone.render import plot_run_loss, plot_run_memory, plot_run_throughput
from fitone.units import gib, parse_size

@dataclass
class RunSummary:
    """The numbers `fitone report` prints. Memory in GiB; samples/s is the median past the first step."""

    run_dir: str
    steps: int  # the last optimizer step logged
    records: int  # logged optimizer steps (training always logs the first and the last)
    first_loss: float | None
    last_loss: float | None
    min_loss: float | None
    min_loss_step: int | None
    median_samples_per_s: float | None
    peak_gpu_gib: float | None
    peak_host_gib: float | None
    skipped_steps: int
    nonfinite_losses: int
    gpu_cap_gib: float | None = None
    eval: dict[str, float] = field(default_factory=dict)  # the last value of each eval metric
    eval_records: int = 0  # held-out scores logged (not counted in records)
    first_loss_step: int | None = None  # 1, as TrainResult's first loss, unless the file was written otherwise

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [
            ("steps", f"{self.steps} ({self.records} logged"
                      + (f", {self.eval_records} held-out score{'s' * (self.eval_records > 1)})" if self.eval_records
                         else ")")),
            ("loss", f"{_f(self.first_loss)} first"
                     + (f" (step {self.first_loss_step})" if self.first_loss_step not in (None, 1) else "")
                     + f", {_f(self.last_loss)} last, {_f(self.min_loss)} min"
                     + (f" (step {self.min_loss_step})" if self.min_loss_step is not None else "")),
            ("samples/s", f"{_f(self.median_samples_per_s, 1)} median"),
            ("peak GPU", f"{_f(self.peak_gpu_gib, 2)} GiB" + (f" of a {self.gpu_cap_gib:.1f} GiB cap"
                                                               if self.gpu_cap_gib else "")),
            ("peak host RSS", f"{_f(self.peak_host_gib, 2)} GiB"),
            ("skipped steps", str(self.skipped_steps)
             + (f", {self.nonfinite_losses} NaN/inf losses" if self.nonfinite_losses else "")),
        ]
        rows += [(k, _f(v)) for k, v in self.eval.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def __str__(self) -> str:
        return f"run {self.run_dir}\n{self.table()}"


@dataclass
class Report:
    summary: RunSummary
    pictures: list[Path]

    def __str__(self) -> str:
        return f"{self.summary}\nwrote " + ", ".join(str(p) for p in self.pictures)


# -- reading ------------------------------------------------------------------------------------------
def read_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's step records, checked: a missing, empty or garbled file is a one-line DataError."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise DataError(f"no run directory {run_dir}: give the --out directory of a `fitone train` run")
    try:
        records = read_metrics(run_dir)
    except DataError as exc:
        if "not valid JSON" in str(exc):
            raise DataError(f"{exc}: repair or delete that line, then run `fitone report` again") from exc
        raise
    where = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not records:
        raise DataError(f"{where} has no step records yet: wait for the first logged step (--log-every N)")
    for i, r in enumerate(records, 1):
        if not (isinstance(r, dict) and _finite(r.get("step")) and any(k in r for k in ("loss", *EVAL_KEYS))):
            raise DataError(f"{where}: record {i} has no 'step' and 'loss': give a metrics.jsonl written by "
                            "`fitone train`")
    return records


def summarize(records: Sequence[dict[str, Any]], *, run_dir: str | Path = "", gpu_cap_gib: float | None = None
              ) -> RunSummary:
    steps = [r for r in records if "loss" in r]  # eval records carry the step they scored, and no loss
    losses = [(r["step"], r["loss"]) for r in steps if _finite(r.get("loss"))]
    # the first step includes lazy allocations and warm-up, as in TrainResult.samples_per_s
    steady = [r["samples_per_s"] for r in records if r["step"] > 1 and _finite(r.get("samples_per_s"))]
    steady = steady or [r["samples_per_s"] for r in records if _finite(r.get("samples_per_s"))]
    best = min(losses, key=lambda sl: sl[1], default=None)
    evals = {k: r[k] for r in records for k in EVAL_KEYS if _finite(r.get(k))}
    return RunSummary(
        run_dir=str(run_dir), steps=int(max(r["step"] for r in records)), records=len(steps),
        first_loss=losses[0][1] if losses else None, last_loss=losses[-1][1] if losses else None,
        min_loss=best[1] if best else None, min_loss_step=best[0] if best else None,
        median_samples_per_s=statistics.median(steady) if steady else None,
        peak_gpu_gib=_max(records, "gpu_peak_gib"), peak_host_gib=_max(records, "host_rss_gib"),
        skipped_steps=int(_max(records, "skipped_steps") or 0),  # DeepSpeed's running count
        nonfinite_losses=sum(1 for r in records if "loss" in r and not _finite(r["loss"])),
        gpu_cap_gib=gpu_cap_gib, eval=evals, eval_records=len(records) - len(steps),
        first_loss_step=losses[0][0] if losses else None,
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    """PNGs of loss, throughput and memory against step in `out` (default RUN_DIR/report/), and a summary."""
    run_dir = Path(run_dir)
    records = read_run(run_dir)
    settings = _run_settings(run_dir)
    cap = _cap_gib(settings)
    summary = summarize(records, run_dir=run_dir, gpu_cap_gib=cap)
    out = Path(out) if out is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / "report"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory for the pictures")
    out.mkdir(parents=True, exist_ok=True)
    title = _title(run_dir, settings)
    pictures = [
        plot_run_loss(records, out / "loss.png", title),
        plot_run_throughput(records, out / "throughput.png", title),
        plot_run_memory(records, out / "memory.png", title, cap, on_cpu=settings.get("device") == "cpu"),
    ]
    return Report(summary=summary, pictures=pictures)


def plot_losses(losses: Sequence[float], path: str | Path, title: str = "fitone train") -> Path:
    """PNG of one loss per optimizer step (TrainResult.plot); NaN/inf steps are marked, not drawn."""
    records = [{"step": i, "loss": v} for i, v in enumerate(losses, 1)]
    if not records:
        raise DataError("no losses to plot: the run did not finish a step")
    return plot_run_loss(records, Path(path), title)


# -- helpers ---------------------------------------------------------------------------------------------
def _run_settings(run_dir: Path) -> dict[str, Any]:
    """The run's config.json (written by `fitone train --out`); {} when absent or unreadable."""
    path = (run_dir if run_dir.is_dir() else run_dir.parent) / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _cap_gib(settings: dict[str, Any]) -> float | None:
    try:
        cap = parse_size(settings.get("max_gpu_memory"))
    except ConfigError:
        return None
    return gib(cap) if cap else None


def _title(run_dir: Path, settings: dict[str, Any]) -> str:
    name = (run_dir if run_dir.is_dir() else run_dir.parent).name
    what = " ".join(str(settings[k]) for k in ("model", "precision") if settings.get(k))
    return f"{name} ({what})" if what else name


def _max(records: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if _finite(r.get(key))]
    return max(values) if values else None


def _f(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if abs(value) >= 10 ** -digits or value == 0 else f"{value:.2e}"
