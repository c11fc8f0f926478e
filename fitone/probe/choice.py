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

Whichever way it is chosen, the pair returned has run real accumulated steps: accumulating holds one more
largest-parameter-sized 16-bit tensor from the second micro-batch on (docs/memory.md), which the search's
one-micro-batch trials never see. A throughput candidate's timing is such a run; any other pair with a > 1
runs `steps` steps of min(a, CHECK_MICRO_STEPS) micro-batches (purpose "check"). A pair that ran out of
memory is never chosen: the choice steps down to the next dividing pair, at most MAX_CHECK_TRIES checks.

Knows nothing of training: `time_step(b, steps, a)` runs the steps and returns their TrialResult.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fitone.config import PREFER_BATCH, dividing
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.probe.results import ProbeResult, TrialResult

MAX_CANDIDATES = 3  # pairs timed: each costs `steps` full accumulated steps
TOLERANCE = 0.02  # a smaller micro-batch must be this much faster than the largest to be chosen
# The extra memory of accumulating is there from the second micro-batch of a step on and does not grow with
# more (one set of held gradients, docs/memory.md), so two micro-batches a step check any accumulation.
CHECK_MICRO_STEPS = 2
MAX_CHECK_TRIES = 3  # pairs checked before giving up, as the search's MAX_VERIFY_TRIES

TimeStep = Callable[[int, int, int], TrialResult]  # (micro-batch, steps, accumulation)


class UncheckedChoice(Exception):
    """The pair needs an accumulated check, and no `time_step` was given (a choice made again from a saved search)."""


def choose_batch(result: ProbeResult, *, prefer: str, accumulation: Callable[[int], int],
                 global_batch: int | None, time_step: TimeStep | None = None, steps: int = 1,
                 log: Callable[[str], None] = print) -> ProbeResult:
    """Set result.micro_batch, .accumulation, .prefer and .global_batch (see the module's docstring).

    "throughput" times candidates with `time_step` (recorded in result.trials, purpose "throughput"); with
    either preference a pair with accumulation > 1 that no fitting accumulated trial covers is checked with
    `time_step` (purpose "check"). Raises accumulation's ConfigError when no b <= chosen divides the global
    batch, MemoryBudgetError when MAX_CHECK_TRIES pairs run out of memory, UncheckedChoice when a pair needs a
    check and `time_step` is None.
    """
    if prefer not in PREFER_BATCH:
        raise ConfigError(f"--prefer-batch must be one of {', '.join(PREFER_BATCH)}, got {prefer!r}")
    pairs = _dividing(result.chosen, accumulation)
    first = pairs[0]
    if prefer == "throughput":
        if time_step is None:
            raise ValueError("a throughput choice needs a time_step function")
        first = _fastest(result, _shortlist(result, pairs), time_step=time_step, steps=steps, log=log) or first
    micro, accum = _checked(result, pairs[pairs.index(first):], time_step=time_step, steps=steps, log=log)
    if prefer == "largest" and global_batch is not None:
        log(f"for --global-batch {global_batch}: {micro} x {accum}, the largest micro-batch that divides it"
            + ("" if (micro, accum) == pairs[0] else " and runs accumulated steps"))
    result.prefer, result.micro_batch, result.accumulation, result.global_batch = prefer, micro, accum, global_batch
    return result


def _dividing(chosen: int, accumulation: Callable[[int], int]) -> list[tuple[int, int]]:
    """(b, a) for every b <= chosen with an exact accumulation, largest b first."""
    pairs = list(dividing(chosen, accumulation))
    if not pairs:
        if chosen > 0:
            accumulation(chosen)  # raises its ConfigError, which names the fix
        raise ConfigError("no micro-batch to choose")
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
             log: Callable[[str], None]) -> tuple[int, int] | None:
    """Time each pair over `steps` steps; the most samples/s, the largest that fitted unless another beats it
    by TOLERANCE. None when every pair ran out of memory."""
    if len(shortlist) == 1:
        log(f"{shortlist[0][0]} x {shortlist[0][1]} is the one candidate: nothing to time")
        return shortlist[0]
    sizes = ", ".join(f"{b} x {a}" for b, a in shortlist)
    log(f"timing {len(shortlist)} (micro-batch x accumulation) candidates over {steps} steps each: {sizes}")
    fitted: list[TrialResult] = []
    for b, a in shortlist:
        trial = dataclasses.replace(time_step(b, steps, a), purpose="throughput")
        result.trials.append(trial)
        log(trial.outcome())
        if trial.fits:
            fitted.append(trial)
    timed = [t for t in fitted if t.samples_per_s is not None]
    if fitted and fitted[0].samples_per_s is None and (fitted[0].batch_size, fitted[0].accumulation) == shortlist[0]:
        log(f"{fitted[0].label} fits but was not timed: choosing it, the largest")
        return shortlist[0]
    if not timed:  # every candidate ran out of memory: the check steps down below them
        return None
    # the comparison's base: the largest candidate that fitted (one that ran out of memory is never chosen)
    largest = max(timed, key=lambda t: t.batch_size)
    if (largest.batch_size, largest.accumulation) != shortlist[0]:
        log(f"{shortlist[0][0]} x {shortlist[0][1]} ran out of memory: comparing with {largest.label}")
    best = max(timed, key=lambda t: (t.samples_per_s, t.batch_size))
    if best is largest or best.samples_per_s < largest.samples_per_s * (1 + TOLERANCE):
        log(f"choosing {largest.label}: the most samples/s ({largest.samples_per_s:.1f}) within "
            f"{TOLERANCE:.0%} is the largest micro-batch that fits")
        return largest.batch_size, largest.accumulation
    gain = best.samples_per_s / largest.samples_per_s - 1
    log(f"choosing {best.label}: {best.samples_per_s:.1f} samples/s, {gain:.0%} more than {largest.label} "
        f"({largest.samples_per_s:.1f})")
    return best.batch_size, best.accumulation


def _checked(result: ProbeResult, pairs: list[tuple[int, int]], *, time_step: TimeStep | None, steps: int,
             log: Callable[[str], None]) -> tuple[int, int]:
    """The first of `pairs` (largest first) that a fitting trial covers, checking pairs that none does.

    Memory grows with the micro-batch, and accumulating (a > 1) takes more than one micro-batch a step, so a
    fit at (b', a') covers (b, a) when b <= b' and (a' > 1 or a == 1), and an out-of-memory excludes it when
    b >= b' and (a > 1 or a' == 1). The search's verification covers every b <= chosen at a == 1.
    """
    checked: list[str] = []
    for b, a in pairs:
        if _excluded(result, b, a):
            continue
        if a == 1 or any(t.fits and t.batch_size >= b and t.accumulation > 1 for t in result.trials):
            return b, a
        if time_step is None:
            raise UncheckedChoice(f"{b} x {a} has not run accumulated steps")
        micro_steps = min(a, CHECK_MICRO_STEPS)
        trial = dataclasses.replace(time_step(b, steps, micro_steps), purpose="check")
        result.trials.append(trial)
        checked.append(f"{b} x {a}")
        if trial.fits:
            log(f"{trial.outcome()} over {steps} steps of {micro_steps} micro-batches: {b} x {a} checked")
            return b, a
        if len(checked) >= MAX_CHECK_TRIES:
            log(trial.outcome())
            raise MemoryBudgetError(
                f"{', '.join(checked)} ran out of memory accumulating although {result.chosen} fitted at one "
                f"micro-batch a step: use a larger --margin (e.g. 0.2) or a smaller --global-batch")
        log(f"{trial.outcome()} accumulating; stepping down to the next micro-batch that divides it")
    raise MemoryBudgetError(f"no micro-batch up to {result.chosen} runs accumulated steps: use a larger "
                            "--margin (e.g. 0.2) or a smaller --global-batch")


def _excluded(result: ProbeResult, b: int, a: int) -> bool:
    """Whether a trial that ran out of memory at b' <= b already rules (b, a) out."""
    return any(not t.fits and t.batch_size <= b and (a > 1 or t.accumulation == 1) for t in result.trials)
