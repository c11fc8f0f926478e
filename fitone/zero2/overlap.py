"""DeepSpeed's ZeRO-2 CPU-offload optimizer step moved into a background thread, beside GPU work.

- `PipelinedUpdate` (the default on one GPU): step N's Adam and upload run chunk by chunk while step
  N+1's forward runs; each module's forward waits for the chunks holding its weights. DeepSpeed's arithmetic.
- `DelayedUpdate` (experimental, fitone.zero2.delayed): step N's update runs beside step N+1's forward and
  backward, whose gradients are therefore taken at weights one update old; it trains worse (README).

Both decide the overflow, loss scale and gradient norm on the main thread where DeepSpeed decides them;
the thread's Adam releases the GIL (DeepSpeed's own `adam_update` holds it: fitone.zero2.cpu_adam), so the
main thread launches kernels meanwhile. Measurements: bench/NOTES.md.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fitone.zero2 import adam32, cpu_adam, gpu_adam, low_precision, ranks
from fitone.zero2 import speculative as speculative_update
from fitone.zero2.layout import CHUNK_ELEMENTS, module_needs
from fitone.zero2.upload import Uploads

UPLOAD_CHUNK = CHUNK_ELEMENTS  # elements per pipelined Adam + upload chunk (fitone.zero2.upload's two chunks)
# DeepSpeedCPUAdam's C++ step runs whole SIMD blocks (up to 16 lanes x 8) and a scalar tail: chunks cut at
# multiples of this give every element the path DeepSpeed's one call per group gives it
SIMD_BLOCK = 256


class OverlappedStep:
    """Replaces `optimizer.step` of a DeepSpeed ZeRO-2 CPU-offload optimizer; subclasses say when and how
    the update is applied. The first `after` applied steps are DeepSpeed's own (early updates are large,
    the fp16 loss scale settles there, and the optimizer states get allocated)."""

    name = "overlapped update"

    def __init__(self, optimizer: Any, *, after: int):
        if not getattr(optimizer, "cpu_offload", False) or not hasattr(optimizer, "single_partition_of_fp32_groups"):
            raise ValueError(f"the {self.name} needs DeepSpeed's ZeRO-2 optimizer with offload_optimizer on the CPU")
        self.opt = optimizer
        self.after = after
        self.applied = 0  # steps applied, DeepSpeed's and ours (overflowed ones are not counted)
        self.pending: Future | None = None
        # the last update sync() completed, in wall-clock seconds for the benchmark's split: adam_s (Adam in the
        # thread), thread_s (the thread's whole update), wait_s (the main thread blocked on it; the GPU may
        # still run queued work meanwhile)
        self.last_timing: dict[str, float] | None = None
        self._wait_s = 0.0  # the pending update's wait_s so far
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fitone-update")
        self._plain_step = optimizer.step
        optimizer.step = self.step  # DeepSpeed's engine calls optimizer.step() at each boundary

    # -- the step DeepSpeed's engine calls ------------------------------------------------------------
    def step(self, closure: Any = None) -> None:
        if self.applied < self.after:
            self._first_step()
            self.applied += not self.opt.overflow
            return
        decided = self._prologue()
        if decided is not None:
            self._launch(*decided)
            self.applied += 1

    def _first_step(self) -> None:
        """One of the first `after` steps: DeepSpeed's own, applied before it returns."""
        self._plain_step()

    def _prologue(self) -> tuple[torch.Tensor | None, list[dict[str, Any]]] | None:
        """DeepSpeed's step up to the update: host gradients complete, overflow, norm, loss scale.
        Returns (DeepSpeed's scaled global gradient norm, hyperparameters per group), or None for a dropped
        (overflowed) step."""
        from deepspeed.runtime.utils import is_invalid_grad_norm
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt = self.opt
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt._wait_for_offload_copies()
        opt._offload_accumulated_param_ids = set()
        if not opt.compute_grad_norm:
            opt._global_grad_norm = None
        opt.overflow = False
        if opt.check_grad_overflow:
            opt.check_overflow(partition_gradients=opt.partition_gradients)
        norm = None
        if opt.compute_grad_norm and not opt.overflow:
            norm = opt.scaled_global_norm()
            if (opt.dtype != torch.bfloat16 or opt.check_grad_overflow) and is_invalid_grad_norm(norm):
                opt.overflow = True
        prev_scale = opt.loss_scale
        opt._update_scale(opt.overflow)
        if opt.overflow:  # dropped as DeepSpeed drops it; an update already running (earlier, good) still lands
            if opt.compute_grad_norm:
                opt._global_grad_norm = float("inf")
            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            opt.reset_cpu_buffers()
            return None
        if norm is not None:
            opt._global_grad_norm = norm / prev_scale
        return norm, self.hyperparameters()

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each group's Adam hyperparameters as the step will use them (the scheduler moves lr after it)."""
        return [dict(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"],
                     bias_correction=g.get("bias_correction", True)) for g in self.opt.optimizer.param_groups]

    def _combined_scale(self, norm: torch.Tensor | None) -> float | None:
        """What DeepSpeed's unscale_and_clip_grads divides by (loss scale x clip factor), or None for 1."""
        opt = self.opt
        if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
            return None
        combined = float(opt.loss_scale)
        if opt.clip_grad > 0.0 and norm is not None:
            clip = ((float(norm) / opt.loss_scale) + 1e-6) / opt.clip_grad
            combined = max(clip, 1.0) * opt.loss_scale
        return combined

    def _release_step_buffers(self) -> None:
        opt = self.opt
        for i in range(len(opt.bit16_groups)):
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
        opt.reset_cpu_buffers()

    def _adam(self, i: int, grad: torch.Tensor, scale: float | None, hyper: dict[str, Any], step: int,
              lo: int = 0, hi: int | None = None, out: torch.Tensor | None = None) -> None:
        """AdamW on elements [lo, hi) of group i's fp32 master and DeepSpeedCPUAdam's states for it, from
        `grad` (those elements' gradient: fp32 by PyTorch's fused kernel, 16-bit by fitone.zero2.adam32's, the same
        bits), with the unscale/clip folded in (one pass over the gradients instead of DeepSpeed's two); `out` gets
        the new master's 16-bit cast."""
        adam = self.opt.optimizer
        master = self.opt.single_partition_of_fp32_groups[i]
        state, sl = adam.state[master], slice(lo, hi)
        adam32.step(master.data[sl], state["exp_avg"][sl], state["exp_avg_sq"][sl], grad, out=out, step=step,
                    lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                    grad_scale=scale, adam_w_mode=getattr(adam, "adam_w_mode", True))

    def state(self, i: int) -> dict[str, Any]:
        """DeepSpeedCPUAdam's state for group i, made as its first step makes it where it does not exist yet
        (bf16-kahan's compensation is made with the update)."""
        master = self.opt.single_partition_of_fp32_groups[i]
        state = self.opt.optimizer.state[master]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master.data)
            state["exp_avg_sq"] = torch.zeros_like(master.data)
        return state

    def _next_step(self, i: int) -> int:
        """Count this step in group i's state."""
        state = self.state(i)
        state["step"] += 1
        return state["step"]

    def _launch(self, norm: torch.Tensor | None, hyper: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def before_backward(self) -> None:
        """Called before each backward, which writes the host gradient buffers."""

    # -- applying what is pending ---------------------------------------------------------------------
    def sync(self) -> None:
        """Finish the pending update and put its weights on the model (a no-op when none is pending):
        call it before anything reads the weights or the optimizer state (checkpoint, export, the end)."""
        raise NotImplementedError

    def _result(self, pending: Future) -> dict[str, float]:
        """The thread's timing of a pending update, once done (the main thread's wait counted)."""
        t0 = time.perf_counter()
        try:
            return pending.result()  # re-raises what the thread raised
        finally:
            self._wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Apply what is pending, stop the thread and give DeepSpeed its own step back."""
        try:
            self.sync()
        finally:
            self._pool.shutdown(wait=True)
            self.opt.step = self._plain_step


class PipelinedUpdate(OverlappedStep):
    """Step N's update, chunk by chunk in flat-buffer order (the order the model's parameters are
    declared, which is close to the order the forward uses them), runs while step N+1's forward runs.
    Each chunk's master goes up into the 16-bit weights through fitone.zero2.upload: as it is, cast on the GPU (its
    opt-in HOST_CAST: cast on the host as Adam writes it).

    On the lean host layout (`host`, fitone.zero2.layout.LeanHost; the engine's case) Adam reads each chunk's bf16
    gradient as it is (fitone.zero2.adam32, PyTorch's fused AdamW's bits; fp16 ones, or where its op cannot be
    built, widened a slice at a time); the first `after` steps, DeepSpeed's arithmetic, run the same chunks in
    the thread through its unscale/clip and C++ Adam, widened a slice at a time (its own step needs a whole fp32
    gradient). Without `host` (DeepSpeed's layout) its fp32 gradients are read and its own step runs first.

    `states` 'bf16', 'bf16-nearest' or 'bf16-kahan' (on `host` only; DeepSpeed built with
    bf16_master_weights_and_grads and bf16_optimizer_states): every step, the first ones too, is
    fitone.zero2.low_precision's fused step on the bf16 master and moments, from the 16-bit gradients as they
    are (a chunk at a time, none widened), rounded stochastically (bits keyed by `rounding_seed`), to the
    nearest, or to the nearest with a bf16 compensation buffer (made here, in the optimizer's state, so that
    checkpoints carry it).

    `speculative` (opt-in, fp32 states, one rank): chunks' Adam run in the boundary backward, kept where
    bit-identical, else redone or undone (fitone.zero2.speculative). Several ranks: each updates its partition,
    whose chunks are all-gathered as the forward waits (fitone.zero2.ranks). `model`: the engine's module
    (forward pre-hooks go on its submodules)."""

    name = "pipelined update"

    def __init__(self, optimizer: Any, model: torch.nn.Module, *, after: int, chunk_elements: int | None = None,
                 host: Any = None, states: str = "fp32", rounding_seed: int = 0, speculative: bool = False,
                 gpu_share: float = 0.0):
        """chunk_elements: per Adam + upload chunk (default: the lean layout's chunk, else UPLOAD_CHUNK);
        speculative: Adam on chunks during the boundary backward (fitone.zero2.speculative; exact mode only);
        gpu_share: that fraction of the fp32 Adam's chunks stepped on the GPU (fitone.zero2.gpu_adam; one GPU)."""
        super().__init__(optimizer, after=after)
        self.ranks = ranks.Partitions(optimizer)  # several ranks: chunks are all-gathered as the forward waits
        self.rounding = low_precision.ROUNDING_OF_STATES.get(states)  # None: fp32 states, fused AdamW
        self._bits = low_precision.RandomBits(rounding_seed) if self.rounding == low_precision.STOCHASTIC else None
        if self.rounding is not None:
            low_precision.fused_op()  # built here, on the first run of this machine, not in the update thread
        self.compensated = states in low_precision.COMPENSATED
        bf16_master = optimizer.single_partition_of_fp32_groups[0].dtype == torch.bfloat16
        if (self.rounding is not None) != bf16_master or (bf16_master and (host is None or self.ranks.several)):
            self.close()
            raise ValueError(f"optimizer states {states} need one rank's lean layout on DeepSpeed's bf16 master "
                             "weights and states (bf16_master_weights_and_grads, bf16_optimizer_states), and only they")
        chunk_elements = chunk_elements or (host.chunk_elements if host is not None else UPLOAD_CHUNK)
        if host is not None and (chunk_elements % SIMD_BLOCK or host.widen_elements % SIMD_BLOCK
                                 or chunk_elements > host.chunk_elements
                                 or not hasattr(optimizer.optimizer, "ds_opt_adam")):
            self.close()
            raise ValueError(f"the pipelined update on the lean layout runs DeepSpeedCPUAdam in chunks and "
                             f"widened slices of a multiple of {SIMD_BLOCK} elements, chunks at most the "
                             f"layout's {host.chunk_elements}")
        if speculative and (self.rounding is not None or host is None or self.ranks.several):
            self.close()
            raise ValueError("the speculative update runs on one rank's lean layout with fp32 optimizer states only")
        self.host = host
        cpu_adam.releasing_op(optimizer.optimizer)  # built here (first run of a machine), not in the update thread
        # the fp32 Adam reads the 16-bit gradients as they are (fitone.zero2.adam32), unless its op cannot be built
        self.reads_16bit = (host is not None and host.widens and self.rounding is None
                            and all(adam32.reads(g.dtype) for g in host.gradients))
        for master in optimizer.single_partition_of_fp32_groups if self.compensated else []:
            optimizer.optimizer.state[master]["compensation"] = torch.zeros_like(master.data)
        self.chunks = self._plan_chunks(chunk_elements)  # per group: chunk ends (exclusive), ascending
        self.ready: list[list[threading.Event]] = []  # per group and chunk: set by the thread when uploaded
        self.uploaded: list[list[Any]] = []  # per group and chunk: a CUDA event (None on the CPU)
        self.waited: list[int] = []  # per group: chunks the main stream already waited for, this step
        self._failed = False  # the thread raised: its `finally` sets every chunk ready before the future is done
        self._side = torch.cuda.Stream() if optimizer.bit16_groups_flat[0].is_cuda else None  # the uploads' stream
        size = max(hi - lo for ends in self.chunks for lo, hi in zip([0] + ends[:-1], ends))
        self.uploads = Uploads(optimizer, self._side, size)
        self._hooks = [m.register_forward_pre_hook(self._pre_forward(needs))
                       for m, needs in module_needs(optimizer, model, self.ranks.sizes)]
        self._kept = self._redo = frozenset()  # (group, chunk)s speculated as the update runs them / at another scale
        self._speculated: dict[str, float] = {}  # the pending update's speculation counters (timing dict)
        self.speculation = speculative_update.Speculation(self) if speculative else None
        self.gpu_share = gpu_adam.share_for(self, gpu_share)  # None: the CPU steps every chunk

    def _plan_chunks(self, chunk_elements: int) -> list[list[int]]:
        return [list(range(chunk_elements, p.numel(), chunk_elements)) + [p.numel()]
                for p in self.opt.single_partition_of_fp32_groups]

    def _pre_forward(self, needs: list[tuple[int, int]]):
        def hook(_module: torch.nn.Module, _inputs: Any) -> None:
            if not self.ready:
                return
            for i, end in needs:
                self._wait_for(i, bisect.bisect_left(self.chunks[i], end))
        return hook

    def _wait_for(self, i: int, last_chunk: int) -> None:
        """Block until chunks [0, last_chunk] of group i are uploaded; order the GPU stream after them."""
        while self.waited[i] <= last_chunk:
            c = self.waited[i]
            t0 = time.perf_counter()
            self.ready[i][c].wait()
            self._wait_s += time.perf_counter() - t0
            if self._failed and self.pending is not None:  # the thread failed: raise here (once, as sync
                pending, self.pending = self.pending, None  # does), before a forward reads a stale chunk
                pending.result()
            self.ranks.arrived(self, i, c)  # the GPU stream follows its upload (several ranks: and its gather)
            self.waited[i] = c + 1

    def before_backward(self) -> None:
        """The update reads this step's gradient buffers, which the backward is about to overwrite: the
        forward has normally waited for every chunk already; this covers weights it did not use."""
        for i, ends in enumerate(self.chunks if self.ready else []):
            self._wait_for(i, len(ends) - 1)
        if self.speculation is not None:  # every chunk's last Adam has run: this backward may speculate
            self.speculation.arm()

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        if self.speculation is not None:  # an overflowed step launched nothing: its speculation is undone
            self.speculation.drop()

    def _first_step(self) -> None:
        if self.host is None:
            return super()._first_step()
        decided = self._prologue()
        if decided is not None:  # in the thread like every later step (its own arithmetic): no step waits whole
            norm, hyper = decided
            self._launch(None if norm is None else norm.detach().to("cpu"), hyper, deepspeeds=True)

    def _launch(self, norm: torch.Tensor | None, hyper: list[dict[str, Any]], deepspeeds: bool = False) -> None:
        """Start the update in the thread; `deepspeeds`: with DeepSpeed's unscale/clip and CPU Adam."""
        combined = self._combined_scale(norm)  # loss scale x clip factor, what the kernels divide by
        if self.rounding is not None:  # the 16-bit arithmetic from the first step on
            kernel, scale = self._adam_16bit, combined
        elif deepspeeds:
            kernel, scale = self._deepspeeds_adam, norm
        else:
            kernel, scale = self._adam, combined
        kept = redo = frozenset()
        if self.speculation is not None:  # what it ran as `kernel` will is kept or redone, the rest undone (sync drops)
            kept, redo = self.speculation.resolve(kernel, scale, hyper, combined != self._combined_scale(None))
        speculated = {} if self.speculation is None else dict(self.speculation.this_step)
        self.sync()  # the previous update is complete (the forward and backward since needed all of it)
        grads = None if self.host is not None else [p.grad for p in self.opt.single_partition_of_fp32_groups]
        self._release_step_buffers()
        steps = [self._next_step(i) for i in range(len(self.chunks))]
        self.ready = [[threading.Event() for _ in ends] for ends in self.chunks]
        self.uploaded = [[None] * len(ends) for ends in self.chunks]
        self.waited = [0] * len(self.chunks)
        self.ranks.restart()
        self._wait_s = 0.0
        self._failed = False
        done = None
        if self._side is not None:  # the copies must not overwrite weights the last backward still reads
            done = torch.cuda.Event()
            done.record()
        self._kept, self._redo, self._speculated = kept, redo, speculated
        self.pending = self._pool.submit(self._cpu_update, kernel, grads, scale, hyper, steps, done)

    def speculated(self, i: int, c: int) -> bool:
        """Whether the pending update's chunk c of group i was speculated (kept as it is, or to be redone)."""
        return (i, c) in self._kept or (i, c) in self._redo

    def _deepspeeds_adam(self, i: int, grad: torch.Tensor, norm: torch.Tensor | None, hyper: dict[str, Any],
                         step: int, lo: int, hi: int) -> None:
        cpu_adam.deepspeeds_chunk(self.opt, i, grad, norm, hyper, step, lo, hi)

    def _adam_16bit(self, i: int, grad: torch.Tensor, scale: float | None, hyper: dict[str, Any], step: int,
                    lo: int, hi: int) -> None:
        low_precision.chunk_step(self.opt, i, grad, scale, hyper, step, lo, hi, rounding=self.rounding,
                                 bits=self._bits, compensated=self.compensated)

    def _cpu_update(self, kernel: Any, grads: list[torch.Tensor] | None, scale: Any, hyper: list[dict[str, Any]],
                    steps: list[int], backward_done: Any) -> dict[str, float]:
        """Adam (`kernel`) and the upload, chunk by chunk (background thread); returns its timing."""
        opt = self.opt
        try:
            if backward_done is not None:
                torch.cuda.set_device(self._side.device)  # a new thread starts on device 0
                self._side.wait_event(backward_done)
            start = time.perf_counter()
            adam_s = 0.0
            kept, redo = self._kept, self._redo
            share = self.gpu_share if kernel == self._adam and grads is None else None  # fp32 Adam, 16-bit grads
            if share is not None:
                share.start(backward_done)
            for i, master in enumerate(opt.single_partition_of_fp32_groups):
                target = self.ranks.own(i)
                lo = 0
                for c, hi in enumerate(self.chunks[i]):
                    if share is not None and share.took(self, i, c, lo, hi, scale, hyper[i], steps[i], target):
                        lo = hi
                        continue
                    fresh = (i, c) not in kept and (i, c) not in redo
                    out = self.uploads.out(target.data[lo:hi]) if fresh else None  # where Adam writes its cast
                    t0 = time.perf_counter()
                    cast = False
                    if (i, c) in redo:  # speculated at another scale (clipping fired, a new loss scale)
                        self.speculation.redo(scale, i, lo, hi)
                    elif (i, c) not in kept:  # a kept speculation already ran this very Adam on the chunk
                        cast = self._adam_chunk(kernel, grads, scale, hyper[i], steps[i], i, lo, hi, out)
                    adam_s += time.perf_counter() - t0
                    self.uploaded[i][c] = self.uploads.send(master.data[lo:hi], target.data[lo:hi], cast)
                    self.ready[i][c].set()
                    lo = hi
            timing = {"adam_s": adam_s, "thread_s": time.perf_counter() - start}
            return timing if share is None else {**timing, **share.finish()}  # its states back on the host
        except BaseException:
            self._failed = True  # before `finally` wakes the main thread, which then raises instead of reading on
            raise
        finally:  # never leave the main thread waiting on a chunk that will not come
            for events in self.ready:
                for event in events:
                    event.set()

    def _adam_chunk(self, kernel: Any, grads: list[torch.Tensor] | None, scale: Any, hyper: dict[str, Any],
                    step: int, i: int, lo: int, hi: int, out: torch.Tensor | None = None) -> bool:
        """`kernel` on elements [lo, hi) of group i: from the 16-bit gradient as it is where the kernel reads it (the
        16-bit step; the fp32 Adam where `reads_16bit`, which also writes the master's 16-bit cast into `out`), else
        a widened slice at a time (fp32 gradients: at once). Returns whether `out` was written."""
        if grads is None and self.rounding is None and self.reads_16bit and kernel == self._adam:
            kernel(i, self.host.gradients[i][lo:hi], scale, hyper, step, lo, hi, out=out)
            return out is not None
        if grads is None and self.rounding is not None:
            kernel(i, self.host.gradients[i][lo:hi], scale, hyper, step, lo, hi)
            return False
        piece = (self.host.widen_elements if grads is None and self.host.widens else None) or hi - lo
        for a in range(lo, hi, piece):
            b = min(a + piece, hi)
            kernel(i, self.host.fp32_gradient(i, a, b) if grads is None else grads[i][a:b], scale, hyper, step, a, b)
        return False

    def sync(self) -> None:
        if self.speculation is not None:  # a speculation no step resolved (read or saved now) is undone
            self.speculation.drop()
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        timing = {**self._result(pending), **self._speculated}
        for i, ends in enumerate(self.chunks):
            self._wait_for(i, len(ends) - 1)  # the GPU stream now follows every upload
        self.uploads.synchronize()  # the uploads have read the master: the next update may write it
        self.ready = []
        self.last_timing = {**timing, "wait_s": self._wait_s}
        self.opt._lazy_init_hp_params_optimizer_state()

    def close(self) -> None:
        try:
            super().close()
        finally:
            for handle in getattr(self, "_hooks", []):
                handle.remove()
            if getattr(self, "speculation", None) is not None:  # undoes a speculation whose step never came
                self.speculation.close()
            if getattr(self, "gpu_share", None) is not None:  # its pages unlocked before DeepSpeed frees them
                self.gpu_share.close()
