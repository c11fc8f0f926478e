"""Per-phase timing of engine steps, for benchmarks: off unless a caller asks for it.

Each phase runs between syncs (CUDA's on a GPU), so its time is its own but overlap between phases is gone:
that is why training never turns it on. A caller wraps the engines it wants timed in `timed_engines()`;
every `fitone.engine.Engine` built inside gets a PhaseTimer (`engine.timer`), which records per optimizer
step `forward_s`, `backward_s` (with ZeRO-2's gradient reduction and copies to the host, which run in
backward hooks) and `optimizer_s`, plus an overlapped update's own counters. From step `detail_from` on it
also times ZeRO-2's parts inside the step (`OptimizerDetail`): deepspeed 0.19.8's
`runtime/zero/stage_1_and_2.py` names, hence this module's place.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from contextvars import ContextVar
from typing import Any, Callable, Iterator

Sync = Callable[[], None]


def _nothing() -> None:
    pass


def device_sync(on_gpu: bool) -> Sync:
    import torch

    return torch.cuda.synchronize if on_gpu else _nothing


class _Wrapper:
    """Swaps methods of a live object for versions timed between syncs, and puts them back."""

    def __init__(self, sync: Sync, times: dict[str, float]):
        self.sync, self.times = sync, times
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if not callable(fn):
            return
        sync, times = self.sync, self.times

        def timed(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                times[label] += time.perf_counter() - t0

        self._undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, timed)

    def restore(self) -> None:
        for obj, name, old in reversed(self._undo):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._undo.clear()


_MISSING = object()


class _SyncTimers:
    """Stands in for the ZeRO optimizer's own timers: synchronised wall-clock sums, never printed."""

    class _Timer:
        def __init__(self, owner: _SyncTimers, name: str):
            self.owner, self.name, self.t0 = owner, name, None

        def start(self) -> None:
            self.owner.sync()
            self.t0 = time.perf_counter()

        def stop(self, **_: Any) -> None:
            self.owner.sync()
            if self.t0 is not None:
                self.owner.times[self.name] += time.perf_counter() - self.t0
            self.t0 = None

        def reset(self) -> None:
            self.t0 = None

        def elapsed(self, **_: Any) -> float:
            return self.owner.times[self.name] * 1000

    def __init__(self, sync: Sync, times: dict[str, float]):
        self.sync, self.times, self._timers = sync, times, {}

    def __call__(self, name: str) -> _SyncTimers._Timer:
        return self._timers.setdefault(name, self._Timer(self, name))

    def log(self, *_: Any, **__: Any) -> None:
        pass

    def get_timers(self) -> dict[str, Any]:
        return self._timers

    def get_mean(self, *_: Any, **__: Any) -> None:
        return None


class OptimizerDetail:
    """ZeRO-2's parts of a step, each between syncs: `grad_transfer_s` (reduce_ipg_grads: buckets reduced and
    copied to the host, in backward), `grad_norm_s` (scaled_global_norm), `unscale_clip_s` (timer
    optimizer_gradients), `cpu_adam_s` (_optimizer_step), `param_upload_s` (timer optimizer_step minus
    cpu_adam_s), `allgather_s`, and from the step's phases `backward_compute_s` and `optimizer_other_s`."""

    def __init__(self, optimizer: Any, sync: Sync):
        self.optimizer = optimizer
        self.times: dict[str, float] = defaultdict(float)
        self._wrapper = _Wrapper(sync, self.times)
        for name, label in (("reduce_ipg_grads", "grad_transfer_s"), ("scaled_global_norm", "grad_norm_s"),
                            ("_optimizer_step", "cpu_adam_s")):
            self._wrapper.wrap(optimizer, name, label)
        self._timers = getattr(optimizer, "timers", None)
        if self._timers is not None:
            optimizer.timers = _SyncTimers(sync, self.times)

    def take(self, phases: dict[str, float]) -> dict[str, float]:
        """This step's parts (and the sums restart), given its forward/backward/optimizer phases."""
        t = dict(self.times)
        self.times.clear()
        out = {k: t[k] for k in ("grad_transfer_s", "grad_norm_s", "cpu_adam_s") if k in t}
        if "optimizer_gradients" in t:
            out["unscale_clip_s"] = t["optimizer_gradients"]
        if "optimizer_step" in t:
            out["param_upload_s"] = max(0.0, t["optimizer_step"] - t.get("cpu_adam_s", 0.0))
        if "optimizer_allgather" in t:
            out["allgather_s"] = t["optimizer_allgather"]
        if "backward_s" in phases:
            out["backward_compute_s"] = max(0.0, phases["backward_s"] - out.get("grad_transfer_s", 0.0))
        if "optimizer_s" in phases:
            listed = sum(out.get(k, 0.0) for k in ("grad_norm_s", "unscale_clip_s", "cpu_adam_s", "param_upload_s",
                                                    "allgather_s"))
            out["optimizer_other_s"] = max(0.0, phases["optimizer_s"] - listed)
        return out

    def restore(self) -> None:
        self._wrapper.restore()
        if self._timers is not None:
            self.optimizer.timers = self._timers


_UPDATE_NAMES = {"adam_s": "update_cpu_adam_s", "thread_s": "update_thread_s", "wait_s": "update_wait_s",
                 # --speculative-update's (fitone.zero2.speculative): chunks whose Adam ran in the backward
                 "speculated_chunks": "update_speculated_chunks", "rolled_back_chunks": "update_rolled_back_chunks",
                 "speculative_adam_s": "update_speculative_adam_s", "unstarted_chunks": "update_unstarted_chunks",
                 "nonfinite_chunks": "update_nonfinite_chunks", "redone_chunks": "update_redone_chunks",
                 "steps_clipping_persisted": "update_steps_clipping_persisted", "undo_s": "update_undo_s"}


class PhaseTimer:
    """One engine's phases, summed per optimizer step: `steps[i]` the times of step i, `applied[i]` whether it
    updated the weights (fp16 loss scaling skips some)."""

    def __init__(self, optimizer: Any, sync: Sync, *, detail_from: int | None = None,
                 profile: tuple[int, str] | None = None):
        self.optimizer, self.sync, self.detail_from = optimizer, sync, detail_from
        self._profile_at, self._profile_out = profile if profile is not None else (None, None)
        self._profiler: Any = None
        self.steps: list[dict[str, float]] = []
        self.applied: list[bool] = []
        self._times: dict[str, float] = defaultdict(float)
        self._detail: OptimizerDetail | None = None
        self._last_update: dict[str, float] | None = None
        self._maybe_start_detail()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self._times[name] += time.perf_counter() - t0

    def step_done(self, applied: bool, update_timing: dict[str, float] | None = None) -> None:
        """Close an optimizer step; `update_timing`: an overlapped update's counters, kept once per update."""
        step = dict(self._times)
        self._times.clear()
        if self._detail is not None:
            step.update(self._detail.take(step))
        if isinstance(update_timing, dict) and update_timing is not self._last_update:
            self._last_update = update_timing
            step.update({_UPDATE_NAMES[k]: v for k, v in update_timing.items() if k in _UPDATE_NAMES})
        self.steps.append(step)
        self.applied.append(applied)
        self._maybe_start_detail()
        self._maybe_profile()

    def _maybe_profile(self) -> None:
        """torch.profiler over optimizer step `profile_at` (from the end of the step before to the end of its
        own): a Chrome trace and a kernel table at `profile_out` + .trace.json.gz / .table.txt."""
        if self._profile_at is None:
            return
        if self._profiler is None and len(self.steps) == self._profile_at:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        elif self._profiler is not None and len(self.steps) == self._profile_at + 1:
            profiler, self._profiler, self._profile_at = self._profiler, None, None
            profiler.__exit__(None, None, None)
            _write_profile(profiler, self._profile_out)

    def detail_now(self) -> None:
        """Time ZeRO-2's parts from the next optimizer step on."""
        self.detail_from = len(self.steps)
        self._maybe_start_detail()

    def _maybe_start_detail(self) -> None:
        if self._detail is None and self.detail_from is not None and len(self.steps) >= self.detail_from:
            self._detail = OptimizerDetail(self.optimizer, self.sync)

    def close(self) -> None:
        if self._profiler is not None:  # the run ended inside the profiled step
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        if self._detail is not None:
            self._detail.restore()
            self._detail = None
        self.detail_from = self.optimizer = None  # the steps stay readable; the engine's memory can go


def _write_profile(profiler: Any, out: str) -> None:
    import gzip
    import os
    import tempfile

    import torch

    by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(out + ".table.txt", "w") as f:
        f.write(profiler.key_averages().table(sort_by=by, row_limit=60))
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(out + ".trace.json.gz", "wb") as dst:
            dst.write(src.read())


class _Session:
    def __init__(self, phases: bool, detail_from: int | None, on_start: Callable[[], None] | None,
                 on_built: Callable[[Any], None] | None, profile: tuple[int, str] | None = None):
        self.phases, self.detail_from, self.on_start, self.on_built = phases, detail_from, on_start, on_built
        self.profile = profile
        self.timers: list[PhaseTimer] = []


_ACTIVE: ContextVar[_Session | None] = ContextVar("fitone_timed_engines", default=None)


@contextlib.contextmanager
def timed_engines(*, phases: bool = True, detail_from: int | None = None, on_start: Callable[[], None] | None = None,
                  on_built: Callable[[Any], None] | None = None,
                  profile: tuple[int, str] | None = None) -> Iterator[list[PhaseTimer]]:
    """Time every Engine built inside (the list: their timers, in build order). `detail_from`: the optimizer
    step from which ZeRO-2's parts are timed too; `on_start()` runs as each Engine's construction begins and
    `on_built(engine)` once it is built; `profile` (step, path prefix): torch.profiler over that optimizer step
    of the first engine. phases=False: the two callbacks only, no timer and no syncs."""
    session = _Session(phases, detail_from, on_start, on_built, profile)
    token = _ACTIVE.set(session)
    try:
        yield session.timers
    finally:
        _ACTIVE.reset(token)
        for timer in session.timers:
            timer.close()


def timer_for(optimizer: Any, on_gpu: bool) -> PhaseTimer | None:
    """A new engine's timer inside `timed_engines()`, else None (and the engine times nothing)."""
    session = _ACTIVE.get()
    if session is None or not session.phases:
        return None
    profile = session.profile if not session.timers else None
    timer = PhaseTimer(optimizer, device_sync(on_gpu), detail_from=session.detail_from, profile=profile)
    session.timers.append(timer)
    return timer


def engine_starting() -> None:
    session = _ACTIVE.get()
    if session is not None and session.on_start is not None:
        session.on_start()


def engine_built(engine: Any) -> None:
    session = _ACTIVE.get()
    if session is not None and session.on_built is not None:
        session.on_built(engine)
