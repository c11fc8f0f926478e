"""Where a step's time goes, for the tool comparison: fitone.zero2.timing's PhaseTimer, read per optimizer step.

fitone's Engine takes the timer itself (`timed_engines`, in _tools_measure). A raw DeepSpeed engine (the
hand-written loop's, HF Trainer's) gets one here: its public forward / backward / step are swapped for
versions inside the timer's phases, on that one engine object, and put back after.

Every step: `forward_s`, `backward_s` (with ZeRO-2's gradient reduction and GPU -> CPU copies, which run in
backward hooks) and `optimizer_s`, each between syncs and summed over a step's micro-batches, and whether fp16
loss scaling skipped the step. From the extra --split-steps on, ZeRO-2's parts too (`split_detail`:
zero2.timing.OptimizerDetail; its syncs remove overlap, so those steps are not timed). With fitone's
overlapped update, a step in which an update completed also has that update's host counters
(`update_cpu_adam_s`, `update_thread_s`, `update_wait_s`: no syncs added; the wait bounds the GPU's stall from
above, since kernels already queued may still run while the host waits).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from _tools_child import emit, end_init, median_parts, PARTIAL

COARSE = ("forward_s", "backward_s", "optimizer_s")


def split_fields(timer: Any, first: int, last: int, init_peak_gib: float | None = None,
                 detail: tuple[int, int] | None = None) -> dict[str, Any]:
    """split = medians of the timed steps [first, last) that were applied (the update_* keys over those that
    have them); split_detail = medians of the detail steps (`detail`: their range; default every step after)."""
    steps, applied = timer.steps, timer.applied
    lo, hi = detail if detail is not None else (last, len(steps))
    timed = [s for s, ok in zip(steps[first:last], applied[first:last]) if ok]
    coarse = [{k: v for k, v in s.items() if k in COARSE} for s in timed]
    updates = [u for u in ({k: v for k, v in s.items() if k.startswith("update_")} for s in timed) if u]
    detail = [s for s, ok in zip(steps[lo:hi], applied[lo:hi]) if ok]
    out: dict[str, Any] = {"peak_gpu_init_gib": init_peak_gib} if init_peak_gib is not None else {}
    if coarse:
        out["split"] = median_parts(coarse)
        if updates:
            out["split"].update(median_parts(updates))
    if detail:
        out["split_detail"] = median_parts(detail)
    elif steps[lo:hi]:
        out["split_detail_note"] = "every detail step was skipped (fp16 overflow)"
    return out


class EngineSplit:
    """A raw DeepSpeed engine's steps in a PhaseTimer (`timer.steps`, `timer.applied`)."""

    def __init__(self, engine: Any, sync: Callable[[], None], detail_from: int | None):
        from fitone.zero2.timing import PhaseTimer

        self.engine = engine
        self.timer = PhaseTimer(engine.optimizer, sync, detail_from=detail_from)
        self.init_peak_gib: float | None = None
        self.init_s: float | None = None  # deepspeed.initialize, when captured
        self._undo: list[tuple[str, Any]] = []
        self._wrap("forward", "forward_s")
        self._wrap("backward", "backward_s")
        self._wrap("step", "optimizer_s", at_boundary=True)

    @property
    def skipped(self) -> list[bool]:
        return [not ok for ok in self.timer.applied]

    def _wrap(self, name: str, label: str, at_boundary: bool = False) -> None:
        engine, timer, fn = self.engine, self.timer, getattr(self.engine, name)

        def timed(*a: Any, **k: Any) -> Any:
            boundary = at_boundary and engine.is_gradient_accumulation_boundary()  # before step counts this one
            with timer.phase(label):
                result = fn(*a, **k)
            if boundary:
                timer.step_done(self._applied())
            return result

        self._undo.append((name, engine.__dict__.get(name, _MISSING)))
        setattr(engine, name, timed)

    def _applied(self) -> bool:
        if hasattr(self.engine, "was_step_applied"):
            return bool(self.engine.was_step_applied())
        return not getattr(getattr(self.engine, "optimizer", None), "overflow", False)

    def start_detail(self) -> None:
        self.timer.detail_now()

    def fields(self, first: int, last: int) -> dict[str, Any]:
        return split_fields(self.timer, first, last, self.init_peak_gib)

    def restore(self) -> None:
        self.timer.close()
        for name, old in reversed(self._undo):
            if old is _MISSING:
                delattr(self.engine, name)  # the class's method shows again
            else:
                setattr(self.engine, name, old)
        self._undo.clear()


_MISSING = object()


@contextlib.contextmanager
def capture_engines(sync: Callable[[], None], detail_from: int | None) -> Iterator[list[EngineSplit]]:
    """Wrap deepspeed.initialize (its public entry point) so every engine a library builds inside (HF
    Trainer's) gets an EngineSplit, and the GPU peak is read and restarted once the engine is built
    (split.init_peak_gib, then peak_gpu_gib over the steps: the same meaning for every tool)."""
    import deepspeed

    splits: list[EngineSplit] = []
    original = deepspeed.initialize

    def initialize(*a: Any, **k: Any) -> Any:
        emit(PARTIAL, {"phase": "engine init"})
        t0 = time.perf_counter()
        result = original(*a, **k)
        init_s = time.perf_counter() - t0
        engine = result[0] if isinstance(result, tuple) else result
        init_peak = end_init()
        emit(PARTIAL, {"phase": "steps"})
        with contextlib.suppress(Exception):  # instrumentation must never break the tool under test
            splits.append(EngineSplit(engine, sync, detail_from))
            splits[-1].init_peak_gib, splits[-1].init_s = init_peak, init_s
        return result

    deepspeed.initialize = initialize
    try:
        yield splits
    finally:
        deepspeed.initialize = original
