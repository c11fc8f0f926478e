"""What `--batch-size auto` and `fitone probe-batch` train with: a micro-batch and its accumulation.

After the search (search.py) has found `chosen`, the largest micro-batch the margin allows, the choice is
made among micro-batches b <= chosen whose accumulation a for the asked samples per step exists
(`accumulation(b)`, TrainConfig.accumulation: the one owner of that arithmetic; with no --global-batch the
accumulation is --grad-accum, or 1):

- "largest": the largest such b (fitone's choice before issue 29).
- "throughput" (the default): measured, not modelled. A step with accumulation a is a forwards and
  backwards and one optimizer update, which the pipelined update overlaps with the next forward, so how
  much of the update stays exposed depends on b and a together; a fit from one-step trials cannot see
  that. So the few candidates are timed as real accumulated steps on the probe's engine, `steps` steps
  each (median): the largest b, and the b nearest below each of the search's fastest one-step trials.
  The most samples/s wins, but a smaller b must beat the largest by TOLERANCE (timing noise).

Knows nothing of training: `time_step(b, steps, a)` runs the steps and returns their TrialResult.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fitone.config import PREFER_BATCH
from fitone.errors import ConfigError
from fitone.probe.results import ProbeResult, TrialResult

MAX_CANDIDATES = 3  # pairs timed: each costs `steps` full accumulated steps
TOLERANCE = 0.02  # a smaller micro-batch must be this much faster than the largest to be chosen

TimeStep = Callable[[int, int, int], TrialResult]  # (micro-batch, steps, accumulation)


def choose_batch(result: ProbeResult, *, prefer: str, accumulation: Callable[[int], int],
                 global_batch: int | None, time_step: TimeStep | None = None, steps: int = 1,
                 log: Callable[[str], None] = print) -> ProbeResult:
    """Set result.micro_batch, .accumulation, .prefer and .global_batch (see the module's docstring).

    "throughput" times candidates with `time_step` (recorded in result.trials, purpose "throughput");
    "largest" times nothing. Raises accumulation's ConfigError when no b <= chosen divides the global batch.
    """
    if prefer not in PREFER_BATCH:
        raise ConfigError(f"--prefer-batch must be one of {', '.join(PREFER_BATCH)}, got {prefer!r}")
    pairs = _dividing(result.chosen, accumulation)
    largest = pairs[0]
    micro, accum = largest
    if prefer == "throughput":
        if time_step is None:
            raise ValueError("a throughput choice needs a time_step function")
        micro, accum = _fastest(result, _shortlist(result, pairs), time_step=time_step, steps=steps, log=log)
    elif global_batch is not None:
        log(f"for --global-batch {global_batch}: {largest[0]} x {largest[1]}, the largest micro-batch that divides it")
    result.prefer, result.micro_batch, result.accumulation, result.global_batch = prefer, micro, accum, global_batch
    return result


def _dividing(chosen: int, accumulation: Callable[[int], int]) -> list[tuple[int, int]]:
    """(b, a) for every b <= chosen with an exact accumulation, largest b first."""
    pairs, refusal = [], None
    for b in range(chosen, 0, -1):
        try:
            pairs.append((b, accumulation(b)))
        except ConfigError as exc:
            refusal = refusal or exc
    if not pairs:
        raise refusal or ConfigError("no micro-batch to choose")
    return pairs


def _shortlist(result: ProbeResult, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The largest pair, then the pair nearest below each of the fastest one-step trials."""
    by_micro = dict(pairs)
    shortlist = [pairs[0]]
    timed = [t for t in result.trials if t.fits and t.samples_per_s is not None and t.accumulation == 1
             and t.batch_size <= result.chosen]
    for trial in sorted(timed, key=lambda t: (-t.samples_per_s, -t.batch_size)):
        b = max(m for m in by_micro if m <= trial.batch_size)
        if (b, by_micro[b]) not in shortlist:
            shortlist.append((b, by_micro[b]))
        if len(shortlist) == MAX_CANDIDATES:
            break
    return shortlist


def _fastest(result: ProbeResult, shortlist: list[tuple[int, int]], *, time_step: TimeStep, steps: int,
             log: Callable[[str], None]) -> tuple[int, int]:
    """Time each pair over `steps` steps; the most samples/s, the largest unless another beats it by TOLERANCE."""
    if len(shortlist) == 1:
        log(f"{shortlist[0][0]} x {shortlist[0][1]} is the one candidate: nothing to time")
        return shortlist[0]
    sizes = ", ".join(f"{b} x {a}" for b, a in shortlist)
    log(f"timing {len(shortlist)} (micro-batch x accumulation) candidates over {steps} steps each: {sizes}")
    timed: list[TrialResult] = []
    for b, a in shortlist:
        trial = dataclasses.replace(time_step(b, steps, a), purpose="throughput")
        result.trials.append(trial)
        log(trial.outcome())
        if trial.fits and trial.samples_per_s is not None:
            timed.append(trial)
    largest = next((t for t in timed if (t.batch_size, t.accumulation) == shortlist[0]), None)
    if largest is None:  # not measured (or, against the verification, out of memory): nothing to compare to
        log(f"{shortlist[0][0]} x {shortlist[0][1]} was not timed: choosing it, the largest")
        return shortlist[0]
    best = max(timed, key=lambda t: (t.samples_per_s, t.batch_size))
    if best is largest or best.samples_per_s < largest.samples_per_s * (1 + TOLERANCE):
        log(f"choosing {largest.label}: the most samples/s ({largest.samples_per_s:.1f}) within "
            f"{TOLERANCE:.0%} is the largest micro-batch")
        return shortlist[0]
    gain = best.samples_per_s / largest.samples_per_s - 1
    log(f"choosing {best.label}: {best.samples_per_s:.1f} samples/s, {gain:.0%} more than {largest.label} "
        f"({largest.samples_per_s:.1f})")
    return best.batch_size, best.accumulation
