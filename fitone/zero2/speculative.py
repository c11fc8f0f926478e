"""The speculative CPU Adam (--speculative-update, opt-in; fitone.zero2.overlap.PipelinedUpdate's exact mode).

The pipelined update's Adam is on the critical path (the next forward waits for it) while the CPU idles through
the boundary micro-batch's backward. Here a chunk's Adam runs during that backward, in the update's own thread, as
soon as every gradient overlapping the chunk has reached the host: the same kernel on the same arguments the
pipelined update would give it, with the scale it gives when clipping does not fire (the loss scale). At the step
the speculation is kept where it ran exactly what the update runs (same kernel, scale, hyperparameters and step
count): those chunks are the pipelined update's, bit for bit. Where only the scale differs (clipping fired, or a
new loss scale) the update redoes the chunk in its thread, beside the next forward: the AdamW step is inverted in
place from the same gradient (`undo_adamw`'s arithmetic) and taken again at the right scale, block by block in one
pass where fitone.zero2.adam32 runs (`redo_adamw`), else undone and run again. Anything else (an overflow, a step
that never comes, another kernel) undoes it at the step. No copy of the states is kept, so every chunk can be
speculated; the states an undo gives back are the old ones to a few fp32 roundings (tests/zero2/test_speculative.py
bounds them). A chunk whose gradient is not finite is not speculated (an inf cannot be inverted; the update treats
it as without speculation). Finiteness is read on the device, per parameter, as its gradient goes to the host (its
extremes, beside the copy): on the host it cost ~20% of a chunk's Adam (bench/NOTES.md, 2026-12-04d).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable

import torch

from fitone.zero2 import adam32

UNDO_SCRATCH_BYTES = 8  # per element of the chunk being undone: its fp32 gradient and Adam's denominator
# cores the speculative Adam leaves to the backward beside it (autograd's thread launches its kernels and runs the
# gradient hooks); with every core in Adam's OpenMP team the backward ran ~0.2 s longer (bench/NOTES.md, 2026-12-04e)
SPARE_CORES = 1
# consecutive clipped steps after which the next is not speculated: a redo costs more than the Adam it replaces
# (bench/results/2026-12-06b-cpu/), so where clipping persists (a random-init model's every step) the speculation
# only adds work; the first unclipped step ends the streak, and the step after it speculates again. A run starts
# with the streak full: its first applied steps (a random-init model clips them) are not redone (NOTES 2026-12-07b)
CLIP_STREAK = 3


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


def undo_adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               grad_scale: float | None = None, adam_w_mode: bool = True) -> None:
    """Invert, in place, one step of PyTorch's fused AdamW (fitone.zero2.adam32's arithmetic) that took `master`,
    `exp_avg` and `exp_avg_sq` from their old values to these with `grad` divided by `grad_scale` at `step`. Exact
    up to fp32 rounding: a few ulps of the step's inputs (an ulp of the new state, divided by beta)."""
    beta1, beta2 = betas
    g = grad.to(torch.float32, copy=True)  # the buffer is the gradient the update may still read
    if grad_scale is not None:
        g.div_(grad_scale)
    step_size = lr / (1 - beta1 ** step)
    denom = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=step_size)  # before the moments: the step read the new ones
    del denom
    if adam_w_mode:
        if weight_decay:
            master.div_(1 - lr * weight_decay)
    elif weight_decay:
        g.add_(master, alpha=weight_decay)  # Adam's L2 term on the old weights, now restored
    exp_avg.sub_(g, alpha=1 - beta1).div_(beta1)
    exp_avg_sq.addcmul_(g, g, value=-(1 - beta2)).div_(beta2).clamp_(min=0)


def next_ready(ready: list[tuple[Any, ...]]) -> int:
    """Which of the waiting chunks (group, chunk, lo, hi, copy events, ...; in the order the backward gave them)
    to speculate next: the lowest whose copies have landed, else the first given, whose copies land first. Where
    the GPU runs behind the host (a compute-bound backward: the hooks queue every copy early), the lowest waiting
    chunk is the first layers', whose copies land last: waiting on it is the likely reason 224 of llama-7b's 232
    chunks were left unstarted (bench/results/2026-12-06b-gpu/call2/llama-7b/; bench/NOTES.md, 2026-12-06)."""
    landed = [k for k, entry in enumerate(ready) if all(event.query() for event in entry[4])]
    return min(landed, key=lambda k: ready[k][:2]) if landed else 0


class Speculation:
    """The speculative Adam of one PipelinedUpdate (`update`): armed before each backward, fed by the boundary
    copies of the gradients to the host, resolved at the step (`resolve` or `drop`)."""

    def __init__(self, update: Any):
        opt = update.opt
        spans = {}
        for params in opt.params_in_partition:
            for p in params:
                param_id = opt.get_param_id(p)
                i, _, dest_offset, n = opt.grad_position[param_id]
                spans[param_id] = (i, dest_offset, dest_offset + n)
        self.update = update
        self.tracker = ChunkTracker(update.chunks, spans)
        self._lock = threading.Lock()  # the copies may come from autograd's device thread
        self._futures: list[Future] = []
        # chunks to speculate (`next_ready` picks): group, chunk, bounds, copy events, extremes rows
        self._ready: list[tuple[int, int, int, int, list[Any], list[int]]] = []
        self._outstanding: list[tuple[int, int, int, int]] = []  # (group, chunk, lo, hi) whose Adam ran early
        self._events: dict[Hashable, Any] = {}  # on a GPU: each parameter's boundary copy, recorded
        # each parameter's gradient extremes (min, max), copied to the host beside its gradient: its row here
        self._row = {key: row for row, key in enumerate(spans)}
        grads = update.host.gradients
        self._extremes = torch.zeros(len(spans), 2, dtype=grads[0].dtype if grads else torch.float32,
                                     pin_memory=update._side is not None)
        self.armed = False
        self.clip_streak = CLIP_STREAK  # consecutive steps that clipped, up to the last one resolved (see CLIP_STREAK)
        self._persisting = False  # this step's backward was not speculated for the streak (counted at the step)
        # what this step's speculation ran with (set when armed)
        self._kernel, self._scale, self._hyper, self._steps, self._poisoned = None, None, [], [], False
        # cumulative, and this step's (the update's timing dict gets the latter)
        self.totals = self._counters()
        self.this_step = self._counters()
        self._threads = torch.get_num_threads()  # the update's OpenMP team; the speculation's leaves SPARE_CORES
        self._copy = opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu  # the lean layout's boundary copy
        opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = self._copy_and_speculate  # on this optimizer only

    @staticmethod
    def _counters() -> dict[str, float]:
        return {"speculated_chunks": 0, "rolled_back_chunks": 0, "unstarted_chunks": 0, "nonfinite_chunks": 0,
                "redone_chunks": 0, "steps_clipping_persisted": 0, "speculative_adam_s": 0.0, "undo_s": 0.0}

    def _count(self, name: str, value: float) -> None:
        self.this_step[name] += value
        self.totals[name] += value

    # -- during the backward ----------------------------------------------------------------------------
    def arm(self) -> None:
        """Before a backward: undo anything unresolved, then speculate in this backward if its step will be
        a pipelined one (not one of DeepSpeed's first `after`; where `after` is 0 the first step's zero states are
        made here) and clipping has not persisted (CLIP_STREAK; so not before one step has not clipped)."""
        self.drop()
        self.this_step = self._counters()
        upd = self.update
        if upd.applied < upd.after:
            return
        steps = self._coming_steps()  # the first step's states made (zero) here where `after` is 0
        if self.clip_streak >= CLIP_STREAK:  # (counted once a step, at `resolve`: with accumulation each arms)
            self._persisting = True
            return
        self._scale = upd._combined_scale(None)  # what the update divides by when clipping does not fire
        self._hyper = upd.hyperparameters()
        self._steps = steps
        self._kernel = upd._adam
        self._poisoned = False
        self._events = {}
        self.tracker.reset()
        self.armed = True

    def _coming_steps(self) -> list[int]:
        """Each group's step count for the step to come (its state made where it does not exist yet)."""
        return [self.update.state(i)["step"] + 1 for i in range(len(self.update.chunks))]

    def _copy_and_speculate(self, param: torch.nn.Parameter) -> None:
        if not self.armed:
            self._copy(param)
            return
        opt = self.update.opt
        key = opt.get_param_id(param)
        _, source, _, n = opt.grad_position[key]
        if n:  # read before the copy, which lets the gradient go; the copy's event covers this one too
            grad = opt.get_param_gradient_attribute(param).view(-1).narrow(0, source, n)
            self._extremes[self._row[key]].copy_(torch.stack(torch.aminmax(grad)), non_blocking=True)
        self._copy(param)
        event = None
        if self.update._side is not None:  # the copy is queued: the chunk's Adam waits for it
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if not self.armed:  # settled meanwhile: nothing more is started this step
                return
            self._events[key] = event
            done = self.tracker.copied(key)
            if done is None:
                self._poisoned = True  # a slot written twice: nothing speculated this step is kept
                return
            for i, c in done:
                lo, hi = self.tracker.bounds(i, c)
                members = self.tracker.members((i, c))
                events = [self._events[k] for k in members if self._events[k] is not None]
                self._ready.append((i, c, lo, hi, events, [self._row[k] for k in members]))
                self._futures.append(self.update._pool.submit(self._speculate))

    def _speculate(self) -> None:
        """In the update's thread (after the last update, which the pool runs first): Adam on the chunk
        `next_ready` picks, if finite. Among landed chunks the first in the forward's order: the ones the backward
        delivers last are the first layers', which the next forward needs first, so what is left at the step is
        the last layers', which it needs last. Its OpenMP team (this thread's own setting) leaves SPARE_CORES to
        the backward; the update gets all back."""
        torch.set_num_threads(max(1, self._threads - SPARE_CORES))
        try:
            self._speculate_one()
        finally:
            torch.set_num_threads(self._threads)

    def _speculate_one(self) -> None:
        with self._lock:
            if not self._ready:
                return
            i, c, lo, hi, events, rows = self._ready.pop(next_ready(self._ready))
        upd = self.update
        for event in events:
            event.synchronize()
        if upd._side is not None:
            upd._side.synchronize()  # the last update's uploads have read the master this overwrites
        t0 = time.perf_counter()
        # an inf cannot be undone: a chunk is speculated only if every overlapping gradient's extremes are finite
        if not bool(torch.isfinite(self._extremes[rows]).all()):
            self._count("nonfinite_chunks", 1)
            return
        upd._adam_chunk(self._kernel, None, self._scale, self._hyper[i], self._steps[i], i, lo, hi)
        with self._lock:
            self._outstanding.append((i, c, lo, hi))  # undoable from here on (a failed Adam is raised, not undone)
        self._count("speculative_adam_s", time.perf_counter() - t0)  # read by the main thread once settled

    # -- at the step -------------------------------------------------------------------------------------
    def resolve(self, kernel: Any, scale: float | None, hyper: list[dict[str, Any]], clipped: bool = False
                ) -> tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]]]:
        """At the update's launch, before it counts the step, with what it will run (`clipped`: this step clips):
        the (group, chunk)s whose Adam already ran exactly so (the update skips their Adam), and those that ran so
        but at another scale (the update `redo`es them); every other speculated chunk is undone."""
        if self._persisting:
            self._count("steps_clipping_persisted", 1)
            self._persisting = False
        self.clip_streak = self.clip_streak + 1 if clipped else 0
        steps = self._coming_steps()
        error = self._settle()
        same = error is None and not self._poisoned and kernel == self._kernel
        matched = [e for e in self._outstanding
                   if same and hyper[e[0]] == self._hyper[e[0]] and steps[e[0]] == self._steps[e[0]]]
        self._finish(matched, error)
        chunks = frozenset((i, c) for i, c, *_ in matched)
        if scale == self._scale:
            return chunks, frozenset()
        self._count("redone_chunks", len(chunks))
        return frozenset(), chunks

    def redo(self, scale: float | None, i: int, lo: int, hi: int) -> None:
        """In the update's thread: elements [lo, hi) of group i, speculated at the old scale, stepped again at
        `scale` (the one `resolve` found to differ), from the gradient still in the host buffer."""
        upd = self.update
        adam = upd.opt.optimizer
        master = upd.opt.single_partition_of_fp32_groups[i]
        state, hyper = adam.state[master], self._hyper[i]
        if adam32.available():
            adam32.redo_adamw(master.data[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi],
                              upd.host.gradients[i][lo:hi], step=self._steps[i], lr=hyper["lr"],
                              betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                              grad_scale=scale, old_grad_scale=self._scale,
                              adam_w_mode=getattr(adam, "adam_w_mode", True))
        else:  # undone, then the update's own Adam on the chunk
            self._undo([(i, -1, lo, hi)])
            upd._adam_chunk(self._kernel, None, scale, hyper, self._steps[i], i, lo, hi)

    def drop(self) -> None:
        """Undo every unresolved speculation (an overflowed step, a backward whose step never came)."""
        self._finish([], self._settle())

    def _finish(self, kept: list[tuple[int, int, int, int]], error: BaseException | None) -> None:
        """Undo every outstanding chunk not `kept` (kept as they are or redone by the update), count them, then
        raise what the thread raised."""
        rolled = [e for e in self._outstanding if e not in kept]
        self._undo(rolled)
        self._count("speculated_chunks", len(self._outstanding))
        self._count("rolled_back_chunks", len(rolled))
        self._outstanding = []
        if error is not None:
            raise error

    def _settle(self) -> BaseException | None:
        """Stop speculating: chunks not yet started are left to the update (which runs them in the forward's order
        beside it), the one running is waited for; the first error raised, if any."""
        with self._lock:
            self.armed = False
            futures, self._futures = self._futures, []
            left, self._ready = len(self._ready), []
        running = [future for future in futures if not future.cancel()]  # cancel() fails once started
        self._count("unstarted_chunks", left)
        errors = [future.exception() for future in running]  # waits for each, an error or not
        return next((e for e in errors if e is not None), None)

    def _undo(self, entries: list[tuple[int, int, int, int]]) -> None:
        """Invert the speculative Adam on `entries`, from the gradients it read (still in the host buffers:
        the next backward writes them only after `arm` has dropped what is unresolved)."""
        if not entries:
            return
        upd, t0 = self.update, time.perf_counter()
        adam = upd.opt.optimizer
        for i, _c, lo, hi in entries:
            master = upd.opt.single_partition_of_fp32_groups[i]
            state, hyper = adam.state[master], self._hyper[i]
            undo_adamw(master.data[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi],
                       upd.host.gradients[i][lo:hi], step=self._steps[i], lr=hyper["lr"], betas=hyper["betas"],
                       eps=hyper["eps"], weight_decay=hyper["weight_decay"], grad_scale=self._scale,
                       adam_w_mode=getattr(adam, "adam_w_mode", True))
        self._count("undo_s", time.perf_counter() - t0)

    def close(self) -> None:
        """Undo what is unresolved and give the layout its own boundary copy back."""
        try:
            self.drop()
        finally:
            self.update.opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = self._copy
