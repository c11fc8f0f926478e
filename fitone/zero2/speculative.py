"""The speculative CPU Adam (--speculative-update, opt-in; fitone.zero2.overlap.PipelinedUpdate's exact mode).

The pipelined update's Adam is on the critical path (the next forward waits for it) while the CPU idles through
the boundary micro-batch's backward. Here a chunk's Adam runs during that backward, in the update's own thread, as
soon as every gradient overlapping the chunk has reached the host: the same kernel on the same arguments the
pipelined update would give it, with the scale it gives when clipping does not fire (the loss scale). Its fp32
master and moments are backed up first (at most SPECULATIVE_BACKUP_BYTES of chunks a step; the rest wait as
before). At the step the speculation is kept only where it ran exactly what the update would run (same kernel,
scale, hyperparameters and step count); anything else (an overflow, clipping, a new loss scale, DeepSpeed's own
first steps, a step that never comes) restores the backups, and the update redoes those chunks. So the result is
the pipelined update's, bit for bit.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable

import torch

SPECULATIVE_BACKUP_BYTES = 2 * 2**30  # fp32 master + two moments: 12 B an element, so ~180M elements a step


class ChunkTracker:
    """Which chunks of each group have every overlapping parameter's gradient on the host, as they arrive.

    `ends`: per group, the chunks' ends (exclusive, ascending; chunk c is [ends[c-1], ends[c])). `spans`: per
    parameter key, (group, start, stop) of its gradient in the group's flat buffer. A chunk no parameter
    overlaps (padding only) never completes."""

    def __init__(self, ends: list[list[int]], spans: dict[Hashable, tuple[int, int, int]]):
        self.ends = ends
        self._touches: dict[Hashable, list[tuple[int, int]]] = {}
        self._members: dict[tuple[int, int], list[Hashable]] = {}
        for key, (i, start, stop) in spans.items():
            if stop <= start:
                continue
            first, last = bisect.bisect_right(ends[i], start), bisect.bisect_right(ends[i], stop - 1)
            self._touches[key] = [(i, c) for c in range(first, last + 1)]
            for chunk in self._touches[key]:
                self._members.setdefault(chunk, []).append(key)
        self.reset()

    def reset(self) -> None:
        """A new backward: no gradient is on the host yet."""
        self._missing = {chunk: len(keys) for chunk, keys in self._members.items()}
        self._seen: set[Hashable] = set()

    def copied(self, key: Hashable) -> list[tuple[int, int]] | None:
        """Parameter `key`'s gradient is on the host: the (group, chunk)s this completed. None if it was
        copied before in this backward (its slot rewritten after a chunk may have been read)."""
        if key in self._seen:
            return None
        self._seen.add(key)
        done = []
        for chunk in self._touches.get(key, []):
            self._missing[chunk] -= 1
            if self._missing[chunk] == 0:
                done.append(chunk)
        return done

    def members(self, chunk: tuple[int, int]) -> list[Hashable]:
        """The parameters overlapping a (group, chunk)."""
        return self._members.get(chunk, [])

    def bounds(self, i: int, c: int) -> tuple[int, int]:
        return (self.ends[i][c - 1] if c else 0), self.ends[i][c]


class Speculation:
    """The speculative Adam of one PipelinedUpdate (`update`): armed before each backward, fed by the boundary
    copies of the gradients to the host, resolved at the step (`resolve` or `drop`)."""

    def __init__(self, update: Any, budget_bytes: int = SPECULATIVE_BACKUP_BYTES):
        opt = update.opt
        spans = {}
        for params in opt.params_in_partition:
            for p in params:
                param_id = opt.get_param_id(p)
                i, _, dest_offset, n = opt.grad_position[param_id]
                spans[param_id] = (i, dest_offset, dest_offset + n)
        self.update = update
        self.tracker = ChunkTracker(update.chunks, spans)
        total = sum(ends[-1] for ends in update.chunks)
        self._capacity = min(budget_bytes // 4, 3 * total)  # fp32 elements of backup
        self._backup: torch.Tensor | None = None  # allocated at the first armed step
        self._lock = threading.Lock()  # the copies may come from autograd's device thread
        self._futures: list[Future] = []
        self._outstanding: list[tuple[int, int, int, int, int]] = []  # (group, chunk, lo, hi, backup offset)
        self._events: dict[Hashable, Any] = {}  # on a GPU: each parameter's boundary copy, recorded
        self.armed = False
        # what this step's speculation ran with (set when armed)
        self._kernel, self._scale, self._hyper, self._steps, self._poisoned = None, None, [], [], False
        self._used = 0
        # cumulative, and this step's (the update's timing dict gets the latter)
        self.totals = {"speculated_chunks": 0, "rolled_back_chunks": 0, "speculative_adam_s": 0.0}
        self.this_step = dict(self.totals)
        self._copy = opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu  # the lean layout's boundary copy
        opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = self._copy_and_speculate  # on this optimizer only

    # -- during the backward ----------------------------------------------------------------------------
    def arm(self) -> None:
        """Before a backward: undo anything unresolved, then speculate in this backward if its step will be
        a pipelined one on existing states (not one of DeepSpeed's first `after`)."""
        self.drop()
        self.this_step = {"speculated_chunks": 0, "rolled_back_chunks": 0, "speculative_adam_s": 0.0}
        upd, opt = self.update, self.update.opt
        states = [opt.optimizer.state.get(m, {}) for m in opt.single_partition_of_fp32_groups]
        if upd.applied < upd.after or any("step" not in s for s in states):
            return
        self._scale = upd._combined_scale(None)  # what the update divides by when clipping does not fire
        self._hyper = upd.hyperparameters()
        self._steps = [s["step"] + 1 for s in states]
        self._kernel = upd._adam
        if self._backup is None:
            self._backup = torch.empty(self._capacity, dtype=torch.float32)
        self._used = 0
        self._poisoned = False
        self._events = {}
        self.tracker.reset()
        self.armed = True

    def _copy_and_speculate(self, param: torch.nn.Parameter) -> None:
        self._copy(param)
        if not self.armed:
            return
        key = self.update.opt.get_param_id(param)
        event = None
        if self.update._side is not None:  # the copy is queued: the chunk's Adam waits for it
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._events[key] = event
            done = self.tracker.copied(key)
            if done is None:
                self._poisoned = True  # a slot written twice: nothing speculated this step is kept
                return
            for i, c in done:
                lo, hi = self.tracker.bounds(i, c)
                if self._used + 3 * (hi - lo) > self._capacity:
                    continue  # over the budget: this chunk waits for the update, as without speculation
                offset, self._used = self._used, self._used + 3 * (hi - lo)
                events = [self._events[k] for k in self.tracker.members((i, c)) if self._events[k] is not None]
                self._futures.append(self.update._pool.submit(self._speculate, i, c, lo, hi, offset, events))

    def _speculate(self, i: int, c: int, lo: int, hi: int, offset: int, events: list[Any]) -> None:
        """In the update's thread (after the last update, which the pool runs first): back up, then Adam."""
        upd = self.update
        for event in events:
            event.synchronize()
        if upd._side is not None:
            upd._side.synchronize()  # the last update's uploads have read the master this overwrites
        t0 = time.perf_counter()
        master = upd.opt.single_partition_of_fp32_groups[i]
        state = upd.opt.optimizer.state[master]
        n = hi - lo
        for k, source in enumerate((master.data, state["exp_avg"], state["exp_avg_sq"])):
            self._backup[offset + k * n:offset + (k + 1) * n].copy_(source[lo:hi])
        with self._lock:
            self._outstanding.append((i, c, lo, hi, offset))  # restorable from here on, even if Adam raises
        upd._adam_chunk(self._kernel, None, self._scale, self._hyper[i], self._steps[i], i, lo, hi)
        seconds = time.perf_counter() - t0
        self.this_step["speculative_adam_s"] += seconds  # read by the main thread only once settled
        self.totals["speculative_adam_s"] += seconds

    # -- at the step -------------------------------------------------------------------------------------
    def resolve(self, kernel: Any, scale: float | None, hyper: list[dict[str, Any]]) -> frozenset[tuple[int, int]]:
        """At the update's launch, before it counts the step, with what it will run: the (group, chunk)s whose
        Adam already ran exactly so (the update skips their Adam); every other speculated chunk is restored."""
        opt = self.update.opt
        steps = [opt.optimizer.state.get(m, {}).get("step", 0) + 1 for m in opt.single_partition_of_fp32_groups]
        error = self._settle()
        same = (error is None and not self._poisoned and kernel == self._kernel and scale == self._scale)
        kept = [e for e in self._outstanding
                if same and hyper[e[0]] == self._hyper[e[0]] and steps[e[0]] == self._steps[e[0]]]
        self._finish(kept, error)
        return frozenset((i, c) for i, c, *_ in kept)

    def drop(self) -> None:
        """Undo every unresolved speculation (an overflowed step, a backward whose step never came)."""
        self._finish([], self._settle())

    def _finish(self, kept: list[tuple[int, int, int, int, int]], error: BaseException | None) -> None:
        """Restore every outstanding chunk not `kept`, count them, then raise what the thread raised."""
        rolled = [e for e in self._outstanding if e not in kept]
        self._restore(rolled)
        for name, n in (("speculated_chunks", len(self._outstanding)), ("rolled_back_chunks", len(rolled))):
            self.this_step[name] += n
            self.totals[name] += n
        self._outstanding = []
        if error is not None:
            raise error

    def _settle(self) -> BaseException | None:
        """Stop speculating and wait for what was started; the first error it raised, if any."""
        with self._lock:
            self.armed = False
            futures, self._futures = self._futures, []
        errors = [future.exception() for future in futures]  # waits for every one, an error or not
        return next((e for e in errors if e is not None), None)

    def _restore(self, entries: list[tuple[int, int, int, int, int]]) -> None:
        opt = self.update.opt
        for i, _c, lo, hi, offset in entries:
            master = opt.single_partition_of_fp32_groups[i]
            state = opt.optimizer.state[master]
            n = hi - lo
            for k, target in enumerate((master.data, state["exp_avg"], state["exp_avg_sq"])):
                target[lo:hi].copy_(self._backup[offset + k * n:offset + (k + 1) * n])

    def close(self) -> None:
        """Undo what is unresolved and give the layout its own boundary copy back."""
        try:
            self.drop()
        finally:
            self.update.opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = self._copy
