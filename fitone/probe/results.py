"""What `fitone probe-batch` measured: one TrialResult per size tried, and the ProbeResult of a search.

Data only: render.py draws their tables and PNGs (`table()` and `plot()` hand over to it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitone.errors import ConfigError
from fitone.units import gib


@dataclass
class TrialResult:
    """One try at a micro-batch size: `steps` full training steps, or the phase where memory ran out.

    A step is `accumulation` forwards and backwards at `batch_size`, then one optimizer update; `step_s` is
    the median step and `samples_per_s` counts every micro-batch of it.
    """

    batch_size: int
    fits: bool
    peak_gpu_bytes: int | None = None
    step_s: float | None = None
    samples_per_s: float | None = None
    oom_phase: str | None = None  # "forward", "backward" or "step"
    steps: int = 0
    purpose: str = "search"  # "search", "verify" (search_batch_size), "throughput" or "check" (choice.choose_batch)
    accumulation: int = 1

    def __post_init__(self) -> None:
        if self.fits and self.samples_per_s is None and self.step_s:
            self.samples_per_s = self.batch_size * self.accumulation / self.step_s

    @property
    def label(self) -> str:
        """'64', or '16 x 4' for micro-batch 16 with 4 accumulation steps."""
        return f"{self.batch_size}" + (f" x {self.accumulation}" if self.accumulation > 1 else "")

    def outcome(self) -> str:
        """'64 fits: 9.3 GiB peak, 29.8 samples/s' or '256 out of memory in backward'."""
        if not self.fits:
            return f"{self.label} out of memory" + (f" in {self.oom_phase}" if self.oom_phase else "")
        peak = f"{gib(self.peak_gpu_bytes):.1f} GiB peak" if self.peak_gpu_bytes is not None else "peak not measured"
        speed = f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s is not None else ""
        return f"{self.label} fits: {peak}{speed}"


@dataclass(repr=False)
class ProbeResult:
    """What `probe-batch` found; `meta` is filled by the caller.

    `chosen` is the largest micro-batch the margin allows (verified): no choice goes above it. What to train
    with is `micro_batch` x `accumulation`, chosen by `prefer` (fitone.probe.choice) for `global_batch`
    samples per optimizer step on one GPU (None: no --global-batch, the accumulation fixed); None in a
    search's result until a choice is made.
    """

    trials: list[TrialResult]
    largest_fit: int
    chosen: int
    margin: float
    granularity: int
    verified: bool
    best_throughput: int | None  # the fitting size <= chosen with the best samples/s
    cap_bytes: int | None
    wall_s: float
    smallest_oom: int | None = None  # the smallest size above largest_fit that ran out of memory
    prefer: str | None = None  # "throughput" or "largest": how micro_batch x accumulation was chosen
    micro_batch: int | None = None
    accumulation: int | None = None
    global_batch: int | None = None  # the samples per optimizer step (per GPU) they were chosen for
    meta: dict[str, Any] = field(default_factory=dict)

    # -- reading the result -------------------------------------------------------------------
    def __repr__(self) -> str:
        oom = f", smallest_oom={self.smallest_oom}" if self.smallest_oom is not None else ""
        model = f"{self.meta['model']}: " if self.meta.get("model") else ""
        train = (f"micro_batch={self.micro_batch}, accumulation={self.accumulation} ({self.prefer}), "
                 if self.micro_batch is not None else "")
        return (
            f"ProbeResult({model}{train}chosen={self.chosen}, largest_fit={self.largest_fit}{oom}, "
            f"best_throughput={self.best_throughput}, verified={self.verified}, "
            f"{len(self.trials)} trials in {self.wall_s:.1f} s)"
        )

    def memory_line(self) -> tuple[float, float] | None:
        """(fixed bytes, bytes per sample) through the two largest fitting sizes with a measured peak."""
        return trials_memory_line(self.trials)

    def candidates(self) -> list[TrialResult]:
        """The (micro-batch, accumulation) pairs timed for the throughput choice, in the order timed."""
        return [t for t in self.trials if t.purpose == "throughput"]

    def table(self) -> str:
        """Fixed-width table of the trials in the order tried, then the answer."""
        from fitone.render import probe_table  # on call: render, the layer above, draws results (a convenience)

        return probe_table(self)

    def for_global_batch(self, global_batch: int, world_size: int = 1) -> tuple[int, int]:
        """(micro-batch, accumulation steps) for `global_batch` samples per optimizer step.

        The micro-batch is the largest size <= chosen that divides global_batch / world_size exactly,
        so every optimizer step sees exactly `global_batch` samples.
        """
        if global_batch < 1 or world_size < 1:
            raise ConfigError(f"--global-batch ({global_batch}) and the GPU count ({world_size}) must be 1 or more")
        if global_batch % world_size:
            nearest = max(world_size, round(global_batch / world_size) * world_size)
            raise ConfigError(
                f"--global-batch {global_batch} does not split over {world_size} GPUs: use --global-batch {nearest}"
            )
        per_gpu = global_batch // world_size
        micro = next(d for d in range(min(self.chosen, per_gpu), 0, -1) if per_gpu % d == 0)
        return micro, per_gpu // micro

    # -- saving ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        values = dict(data)
        values["trials"] = [TrialResult(**t) for t in values["trials"]]
        return cls(**values)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load_json(cls, path: str | Path) -> "ProbeResult":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # -- plotting -------------------------------------------------------------------------------
    def plot(self, path: str | Path) -> Path:
        """PNG of peak GPU memory and samples/s against batch size, with OOMs, the cap and the choice."""
        from fitone.render import plot_probe  # on call: render, the layer above, draws results (a convenience)

        return plot_probe(self, path)

    def best_trial(self) -> TrialResult | None:
        """The trial with the most samples/s at or below `chosen`; None when none was timed."""
        # Sizes above `chosen` are inside the safety margin, so they are not offered; ties go to the smaller.
        timed = [t for t in self.trials if t.fits and t.samples_per_s is not None and t.batch_size <= self.chosen
                 and t.accumulation == 1]
        return max(timed, key=lambda t: (t.samples_per_s, -t.batch_size), default=None)


def trials_memory_line(trials: list[TrialResult]) -> tuple[float, float] | None:
    """(fixed, per_sample) bytes through the two largest fitting sizes with a measured peak."""
    # one micro-batch a step only: accumulating holds more (fitone.probe.choice)
    peaks = {t.batch_size: t.peak_gpu_bytes for t in trials
             if t.fits and t.peak_gpu_bytes is not None and t.accumulation == 1}
    if len(peaks) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(peaks.items())[-2:]
    per_sample = (p2 - p1) / (b2 - b1)
    if per_sample <= 0:  # noise at tiny sizes: no usable slope
        return None
    return p2 - per_sample * b2, per_sample

