"""DeepSpeed engine lifecycle, in-process: init, one micro-step, save/load, teardown.

The process it runs in (device, distributed env, log levels) is set up first by fitone.runtime; which
optimizer step it takes is decided by fitone.zero2.step_mode and handed in as keyword arguments.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch

from fitone import extensions, memory
from fitone.runtime import ds_chatter
from fitone.zero2 import accumulation, delayed, grad_norm, layout, oom, overflow, overlap, timing


_UNTIMED = contextlib.nullcontext()


class Engine:
    """A DeepSpeed ZeRO-2 engine around a model, with the few operations training and probing need."""

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], *, delayed_after: int | None = None,
                 pipelined: bool = False, states: str = "fp32", rounding_seed: int = 0, speculative: bool = False,
                 gpu_share: float = 0.0):
        """delayed_after: start the one-step delayed parameter update after that many plain steps;
        pipelined: the pipelined update from the second step, on the lean host layout (fitone.zero2);
        states: its optimizer state in 16 bits ('bf16', 'bf16-nearest', 'bf16-kahan': `ds_config` has
        DeepSpeed's bf16 master weights and states), rounded with `rounding_seed`; speculative: its Adam during
        the backward (fitone.zero2.speculative); gpu_share: that fraction of its Adam chunks stepped on the GPU
        (fitone.zero2.gpu_adam). Default: DeepSpeed's step. A run's StepMode.engine_options() gives
        them all."""
        import deepspeed

        timing.engine_starting()  # a benchmark's callback, inside zero2.timing.timed_engines() only
        start = time.perf_counter()
        self.host: layout.LeanHost | None = None
        if pipelined:
            ds_config = layout.lean_offload_config(ds_config)
        self.ds_config = ds_config
        if (ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device") == "cpu":
            extensions.prepare_build("cpu_adam")  # DeepSpeedCPUAdam: no stale lock in its way, a line if it builds
        with ds_chatter():
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=layout.param_groups(model), config=ds_config)
        self.overflow_deferred = overflow.defer_overflow_check(self.optimizer)  # same decision, one sync a step
        grad_norm.one_sum_grad_norm(self.optimizer)  # the clip norm of one group, however many groups
        self.overlap: delayed.DelayedUpdate | overlap.PipelinedUpdate | None = None
        if delayed_after is not None:
            self.overlap = delayed.DelayedUpdate(self.optimizer, after=delayed_after)
        elif pipelined:
            self.host = layout.LeanHost(self.optimizer)
            # DeepSpeed's own first step, except where it would be the one step left unspeculated (no states yet)
            self.overlap = overlap.PipelinedUpdate(self.optimizer, self.ds.module, after=0 if speculative else 1,
                                                   host=self.host, states=states, rounding_seed=rounding_seed,
                                                   speculative=speculative, gpu_share=gpu_share)
        elif states != "fp32":
            raise ValueError(f"optimizer states {states} run in the pipelined update only")
        memory.trim_heap()  # the model's host copy, moved to the GPU, would otherwise stay in the RSS
        # per-phase times for a benchmark inside zero2.timing.timed_engines(); None (no syncs added) otherwise
        self.timer = timing.timer_for(self.optimizer, on_gpu=self.ds.device.type == "cuda")
        self.init_s = time.perf_counter() - start
        timing.engine_built(self)

    def sync_weights(self) -> None:
        """Apply a pending overlapped update to the weights (no-op without one): before anything reads them."""
        if self.overlap is not None:
            self.overlap.sync()

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def train_mode(self, training: bool = True) -> None:
        """Dropout on (training) or off (evaluation), through DeepSpeed's engine as it expects."""
        self.ds.train(training)

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        return _UNTIMED if self.timer is None else self.timer.phase(name)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with self._phase("forward_s"):
            return self.ds(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        if self.overlap is not None:
            self.overlap.before_backward()
        with self._phase("backward_s"):
            self.ds.backward(loss)

    def step(self) -> None:
        """Optimizer step at accumulation boundaries (DeepSpeed counts micro-steps itself)."""
        if self.timer is None:
            self.ds.step()
            return
        boundary = self.ds.is_gradient_accumulation_boundary()  # before ds.step() counts this micro-step
        with self.timer.phase("optimizer_s"):
            self.ds.step()
        if boundary:
            self.timer.step_done(self.last_step_applied, self.overlap.last_timing if self.overlap else None)

    def accumulating(self, steps: int) -> contextlib.AbstractContextManager:
        """`steps` micro-steps to an optimizer step on this engine, built for 1 (the probe times pairs on one
        engine); yields `before_micro_step(i)`, to call before each forward (fitone.zero2.accumulation)."""
        if steps == 1:
            return contextlib.nullcontext(lambda _i: None)
        return accumulation.accumulating(self.ds, self.optimizer, steps)

    @property
    def skipped_steps(self) -> int:
        return self.ds.skipped_steps

    @property
    def last_step_applied(self) -> bool:
        return overflow.step_applied(self.ds)

    @property
    def loss_scale(self) -> float | None:
        if "fp16" not in self.ds_config:
            return None
        return float(getattr(self.optimizer, "loss_scale", 0.0) or 0.0)

    @property
    def grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (DeepSpeed's, unscaled); None before the first step,
        where DeepSpeed does not compute it, or after an overflow."""
        norm = self.ds.get_global_grad_norm()
        value = None if norm is None else float(norm)
        return value if value is not None and math.isfinite(value) else None

    @property
    def update_timing(self) -> dict[str, float]:
        """The overlapped step's last completed update (one step behind the pipelined update's): its thread's
        seconds and, with --speculative-update, its counters (OverlappedStep.last_timing); empty otherwise."""
        return dict(self.overlap.last_timing or {}) if self.overlap is not None else {}

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def reset_after_oom(self) -> None:
        """Make the engine usable after an out-of-memory error in backward or in the optimizer step."""
        self.sync_weights()  # an overlapped update still in flight reads the host buffers reset below
        oom.reset_after_oom(self.ds, self.optimizer)
        memory.free_memory()

    def save(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        self.sync_weights()
        self.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, load_dir: str, tag: str) -> dict[str, Any]:
        with layout.loading_across_layouts(self.ds, self.optimizer):  # a checkpoint from before bounded groups too
            _path, client_state = self.ds.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                                          load_lr_scheduler_states=True)
        if _path is None:
            raise FileNotFoundError(f"{load_dir}/{tag}")
        if self.overlap is not None:  # a resumed run past its plain steps continues overlapped, as it would have
            self.overlap.applied = self.ds.global_steps - self.ds.skipped_steps
        return client_state or {}

    def close(self) -> None:
        """Free the engine's GPU and pinned host memory so a notebook can run another."""
        try:
            if self.timer is not None:  # its wrappers off the optimizer, and its reference to it dropped
                self.timer.close()
            if self.overlap is not None:
                self.overlap.close()
            self.ds.destroy()
        finally:
            if self.host is not None:  # unlock the pages even when a teardown step failed, before they are freed
                self.host.close()
            del self.ds, self.optimizer, self.scheduler, self.overlap, self.host
            memory.free_memory()
