"""The search behind `fitone probe-batch`: the largest micro-batch that fits, then a margin, then a check.

The search is given `try_size(size, steps)`, which runs `steps` full training steps at `size` and reports
an out-of-memory as `TrialResult(fits=False)`; it knows nothing of training. Any other exception from
`try_size` propagates unchanged.

1. Grow: try `start`, then double until a size runs out of memory or `max_batch` is reached (the last
   probe is clamped to `max_batch`). With `cap_bytes` known, a line through the two largest fitting
   sizes (peak = fixed + per_sample x size, as YOLOv5's autobatch) predicts the limit; when it says the
   next doubling would not fit, the predicted size is tried instead, then one granularity step above it
   to confirm. The line is used once, so a wrong prediction costs at most two trials.
2. Bisect between the largest size that fitted (lo) and the smallest that did not (hi) until
   hi - lo <= granularity = max(1, lo // 16): the limit is then known to ~6%, finer than the margin.
   If `start` itself fails, the same bisection from 0 halves down to a size that fits.
   `max_trials` bounds steps 1-2.
3. Margin and verification: chosen = max(1, floor(largest_fit x (1 - margin))), run for `verify_steps`
   steps; if that runs out of memory, step down by max(granularity, margin x size) and verify again (at
   most MAX_VERIFY_TRIES sizes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from fitone.errors import ConfigError, MemoryBudgetError
from fitone.probe.results import ProbeResult, TrialResult, trials_memory_line
from fitone.render import percent
from fitone.units import gib

GRANULARITY_DIVISOR = 16  # bisect until hi - lo <= max(1, lo // 16)
MAX_VERIFY_TRIES = 3  # sizes verified before giving up: more means memory varies far beyond the margin
_EPS = 1e-9  # keeps floor(100 * 0.95) at 95 despite binary fractions

FIX_SMALLER_FOOTPRINT = (
    "use shorter --src-len/--tgt-len (or --seq-len), a larger --max-gpu-memory, --precision bf16 or fp16, "
    "--activation-checkpointing, and run `fitone plan` to see where the memory goes"
)


def granularity_at(size: int) -> int:
    """How close the bisection brings the largest fit and the smallest OOM, at this size."""
    return max(1, size // GRANULARITY_DIVISOR)


def search_batch_size(
    try_size: Callable[[int, int], TrialResult],
    *,
    max_batch: int = 4096,
    max_trials: int = 16,
    margin: float = 0.05,
    start: int = 1,
    verify_steps: int = 3,
    trial_steps: int = 1,
    cap_bytes: int | None = None,
    log: Callable[[str], None] = print,
) -> ProbeResult:
    """Find the largest micro-batch that fits, back off by `margin`, and verify it (see the module doc).

    `try_size(size, steps)` runs `steps` full training steps; search trials run `trial_steps`, the
    verification `verify_steps` (0 skips it: `verified` is then False). `max_trials` bounds the search
    trials; verification adds at most MAX_VERIFY_TRIES. Raises MemoryBudgetError when no size fits.
    """
    check_arguments(max_batch=max_batch, max_trials=max_trials, margin=margin, start=start,
                    verify_steps=verify_steps, trial_steps=trial_steps)
    began = time.perf_counter()
    trials: list[TrialResult] = []

    def run(size: int, steps: int, purpose: str) -> TrialResult:
        trial = dataclasses.replace(try_size(size, steps), purpose=purpose)
        trials.append(trial)
        return trial

    lo = _largest_fit(run, trials, start=start, max_batch=max_batch, max_trials=max_trials,
                      trial_steps=trial_steps, cap_bytes=cap_bytes, log=log)
    chosen, verified = _back_off_and_verify(run, lo, margin=margin, verify_steps=verify_steps,
                                            cap_bytes=cap_bytes, log=log)
    result = ProbeResult(
        trials=trials,
        largest_fit=lo,
        chosen=chosen,
        margin=margin,
        granularity=granularity_at(lo),
        verified=verified,
        best_throughput=None,
        cap_bytes=cap_bytes,
        wall_s=time.perf_counter() - began,
        smallest_oom=min((t.batch_size for t in trials if not t.fits and t.batch_size > lo), default=None),
    )
    best = result.best_trial()
    result.best_throughput = best.batch_size if best is not None else None
    if best is not None and best.batch_size != chosen:
        log(f"best throughput at {best.batch_size}: {best.samples_per_s:.1f} samples/s")
    return result


# -- grow, then bisect -----------------------------------------------------------------------------
Run = Callable[[int, int, str], TrialResult]  # (size, steps, purpose): a trial, recorded


@dataclass
class _Bounds:
    """What the search trials have shown so far."""

    lo: int = 0  # the largest size that fitted
    hi: int | None = None  # the smallest size that did not
    jump: str = "unused"  # the memory-line jump: "unused" -> "confirm" (it fitted; try one step above) -> "used"

    def record(self, size: int, fits: bool) -> None:
        if fits:
            self.lo = max(self.lo, size)
        else:
            self.hi = size if self.hi is None else min(self.hi, size)


def _largest_fit(run: Run, trials: list[TrialResult], *, start: int, max_batch: int, max_trials: int,
                 trial_steps: int, cap_bytes: int | None, log: Callable[[str], None]) -> int:
    """Double from `start` until a size runs out of memory (or the memory line predicts it), then bisect."""
    bounds = _Bounds()
    size = start
    while True:
        trial = run(size, trial_steps, "search")
        bounds.record(size, trial.fits)
        if _stop(trial, bounds, len(trials), max_batch=max_batch, max_trials=max_trials, cap_bytes=cap_bytes,
                 log=log):
            return bounds.lo
        size, why = _next_size(bounds, trials, max_batch=max_batch, cap_bytes=cap_bytes)
        log(f"{trial.outcome()}; {why}")


def _stop(trial: TrialResult, bounds: _Bounds, tried: int, *, max_batch: int, max_trials: int,
          cap_bytes: int | None, log: Callable[[str], None]) -> bool:
    """Whether the search ends after this trial (logging why); raises when it ends with nothing fitting."""
    lo, hi = bounds.lo, bounds.hi
    g = granularity_at(lo)
    if hi is not None and hi - lo <= g:
        if lo == 0:  # hi == 1: even one sample is too much
            log(trial.outcome())
            raise _too_big(trial, cap_bytes)
        log(f"{trial.outcome()}; {lo} fits and {hi} does not (granularity {g}): stopping")
        return True
    if tried >= max_trials:
        log(f"{trial.outcome()}; stopping after max_trials={max_trials} trials")
        if lo == 0:
            raise MemoryBudgetError(
                f"no batch size fitted in {max_trials} trials (smallest tried: {hi}): "
                f"raise --max-trials or start lower"
            )
        return True
    if hi is None and lo >= max_batch:
        log(f"{trial.outcome()}; reached max_batch={max_batch} without running out of memory: stopping")
        return True
    return False


def _next_size(bounds: _Bounds, trials: list[TrialResult], *, max_batch: int,
               cap_bytes: int | None) -> tuple[int, str]:
    """The next size to try, and the log's words for why: bisect, double, or jump along the memory line."""
    lo, hi = bounds.lo, bounds.hi
    if hi is not None:
        size = (lo + hi) // 2
        where = f"bisecting {lo}..{hi}" if lo else "nothing fitted yet, halving"
        return size, f"{where}: trying {size}"
    g = granularity_at(lo)
    size = min(2 * lo, max_batch)
    why = ""
    if bounds.jump == "confirm":
        bounds.jump = "used"
        size = min(lo + g, max_batch)
        why = " (one granularity step above, to confirm the memory line)"
    elif bounds.jump == "unused" and cap_bytes is not None:
        predicted = _predict_limit(trials, cap_bytes)
        if predicted is not None and max(predicted, lo + g) < size:
            bounds.jump = "confirm"
            size = max(predicted, lo + g)
            why = f" (the memory line predicts {predicted} under the {gib(cap_bytes):.1f} GiB cap)"
    return size, f"trying {size}{why}"


# -- margin and verification -----------------------------------------------------------------------
def _back_off_and_verify(run: Run, lo: int, *, margin: float, verify_steps: int, cap_bytes: int | None,
                         log: Callable[[str], None]) -> tuple[int, bool]:
    """(chosen, verified): the largest fit less the margin, stepped down until it runs `verify_steps` steps."""
    chosen = max(1, math.floor(lo * (1 - margin) + _EPS))
    if verify_steps == 0:
        log(f"largest fit {lo}; with a {percent(margin)} margin choosing {chosen} (not verified: verify_steps=0)")
        return chosen, False
    log(f"largest fit {lo}; with a {percent(margin)} margin choosing {chosen}; verifying over {verify_steps} steps")
    g = granularity_at(lo)
    failed: list[int] = []
    while True:
        trial = run(chosen, verify_steps, "verify")
        if trial.fits:
            log(f"{trial.outcome()} over {verify_steps} steps: verified")
            return chosen, True
        failed.append(chosen)
        if chosen == 1:
            log(f"{trial.outcome()} during verification")
            raise _too_big(trial, cap_bytes)
        if len(failed) >= MAX_VERIFY_TRIES:
            log(f"{trial.outcome()} during verification")
            raise MemoryBudgetError(
                f"sizes {', '.join(map(str, failed))} ran out of memory over {verify_steps} steps although "
                f"{lo} fitted in the search: memory varies between steps; use a larger --margin (e.g. 0.2)"
            )
        smaller = max(1, chosen - max(g, math.ceil(chosen * margin)))
        log(f"{trial.outcome()} during verification; stepping down to {smaller}")
        chosen = smaller


# -- helpers ---------------------------------------------------------------------------------------
def check_arguments(**values: Any) -> None:
    """ConfigError naming the fix for each argument that cannot work."""
    wholes = {"max_batch": 1, "max_trials": 1, "start": 1, "verify_steps": 0, "trial_steps": 1}
    for name, least in wholes.items():
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= {least}, got {value!r}")
    if values["start"] > values["max_batch"]:
        raise ConfigError(f"the start size {values['start']} is above --max-batch {values['max_batch']}: "
                          f"raise --max-batch or start lower")
    margin = values["margin"]
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.5:
        raise ConfigError(f"--margin must be a fraction in [0, 0.5), got {margin!r}: e.g. 0.05 backs off 5%")


def _predict_limit(trials: list[TrialResult], cap_bytes: int) -> int | None:
    line = trials_memory_line(trials)
    if line is None:
        return None
    fixed, per_sample = line
    return max(1, math.floor((cap_bytes - fixed) / per_sample + _EPS))


def _too_big(trial: TrialResult, cap_bytes: int | None) -> MemoryBudgetError:
    where = f" in {trial.oom_phase}" if trial.oom_phase else ""
    cap = f" under the {gib(cap_bytes):.1f} GiB cap" if cap_bytes is not None else ""
    return MemoryBudgetError(
        f"batch size {trial.batch_size} runs out of GPU memory{where}{cap}: {FIX_SMALLER_FOOTPRINT}"
    )

