"""One-step delayed parameter update (the ZeRO-Offload paper's DPU) over DeepSpeed's ZeRO-2 CPU offload.

In a ZeRO-2 offload step the GPU waits while the CPU unscales and clips the gradients, runs Adam over
every parameter and stages the new 16-bit weights (~1.2 s of a 2.3 s t5-3b step at micro-batch 64 on an
H200; bench/NOTES.md). Here that CPU work for step N runs in a background thread while the GPU runs the
forward and backward of step N+1 with the weights of step N-1; the new weights are uploaded at the end
of step N+1's backward. So every gradient is computed at weights one update old.

What stays as in DeepSpeed's own step: the overflow check and loss-scale update (fp16) and the gradient
norm are decided on the main thread, on this step's gradients, before anything is handed over — an
overflowed step is dropped exactly as DeepSpeed drops it, never applied. The thread gets its own copy of
the learning rate and betas of this step, and a second host gradient buffer so the next backward's
gradients land beside, not over, the ones being applied.

The update in the thread uses PyTorch's fused CPU AdamW on DeepSpeedCPUAdam's own state tensors:
DeepSpeed's `adam_update` keeps Python's GIL for the whole call (it is bound without releasing it),
which would stall the main thread's kernel launches; PyTorch ops release it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class DelayedUpdate:
    """Replaces `optimizer.step` of a DeepSpeed ZeRO-2 CPU-offload optimizer with the delayed one.

    The first `after` applied steps are plain DeepSpeed steps (early updates are large and the fp16
    loss scale settles there). `sync()` applies the pending update and uploads it: call it before
    anything reads the weights or the optimizer state (checkpoint, evaluation, export, the end).
    """

    def __init__(self, optimizer: Any, *, after: int):
        if not getattr(optimizer, "cpu_offload", False) or not hasattr(optimizer, "single_partition_of_fp32_groups"):
            raise ValueError("the delayed update needs DeepSpeed's ZeRO-2 optimizer with offload_optimizer on the CPU")
        self.opt = optimizer
        self.after = after
        self.applied = 0  # plain + delayed steps applied (overflowed ones are not counted)
        self.spare: list[torch.Tensor] | None = None  # the second gradient buffer per group, made on first use
        self.pending: Future | None = None
        self._uploaded: Any = None  # a CUDA event after the last upload: the staging buffers are free after it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fitone-delayed-update")
        self._plain_step = optimizer.step
        optimizer.step = self.step  # DeepSpeed's engine calls optimizer.step() at each boundary

    # -- the step DeepSpeed's engine calls ------------------------------------------------------------
    def step(self, closure: Any = None) -> None:
        if self.applied < self.after:
            self._plain_step()
            self.applied += not self.opt.overflow
            return
        opt = self.opt
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        # as DeepSpeed's step() begins: this step's host gradients complete, bookkeeping reset
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt._wait_for_offload_copies()
        opt._offload_accumulated_param_ids = set()
        if not opt.compute_grad_norm:
            opt._global_grad_norm = None
        norm, prev_scale = self._decide()
        if opt.overflow:  # dropped as DeepSpeed drops it; the pending update (earlier, good) still lands
            if opt.compute_grad_norm:
                opt._global_grad_norm = float("inf")
            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            opt.reset_cpu_buffers()
            return
        if norm is not None:
            opt._global_grad_norm = norm / prev_scale
        scale = self._combined_scale(norm)
        hyper = [dict(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
                 for g in opt.optimizer.param_groups]
        self.sync()  # step N-1's weights go up now; the GPU then runs step N+1 while the CPU does step N
        grads = self._swap_gradient_buffers()
        for i in range(len(opt.bit16_groups)):
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
        opt.reset_cpu_buffers()
        uploaded = self._uploaded
        self.pending = self._pool.submit(self._cpu_update, grads, scale, hyper, uploaded)
        self.applied += 1

    def _decide(self) -> tuple[torch.Tensor | None, float]:
        """DeepSpeed's own overflow check, gradient norm and loss-scale update, on this step's gradients."""
        from deepspeed.runtime.utils import is_invalid_grad_norm

        opt = self.opt
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
        return norm, prev_scale

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

    def _swap_gradient_buffers(self) -> list[torch.Tensor]:
        """Hand this step's host gradients to the update; the next backward writes into the spare ones.

        DeepSpeed looks the buffer up as `single_partition_of_fp32_groups[i].grad` at every copy, so
        swapping the attribute redirects the next backward's copies.
        """
        groups = self.opt.single_partition_of_fp32_groups
        if self.spare is None:
            self.spare = [torch.zeros_like(p.grad).pin_memory() if p.grad.is_pinned() else torch.zeros_like(p.grad)
                          for p in groups]
        full = [p.grad for p in groups]
        for p, spare in zip(groups, self.spare):
            p.grad = spare
        self.spare = full
        return full

    def _cpu_update(self, grads: list[torch.Tensor], scale: float | None, hyper: list[dict[str, Any]],
                    uploaded: Any) -> None:
        """AdamW on DeepSpeedCPUAdam's states with the unscale/clip folded in (one pass over the gradients
        instead of DeepSpeed's two), then the 16-bit staging copy. Runs in the background thread."""
        opt, adam = self.opt, self.opt.optimizer
        fused = torch._fused_adamw_ if getattr(adam, "adam_w_mode", True) else torch._fused_adam_
        grad_scale = torch.tensor(scale) if scale is not None else None  # unscale and clip inside the kernel
        for i, (master, grad, h) in enumerate(zip(opt.single_partition_of_fp32_groups, grads, hyper)):
            state = adam.state[master]
            if len(state) == 0:  # as DeepSpeedCPUAdam initialises them
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(master.data)
                state["exp_avg_sq"] = torch.zeros_like(master.data)
            state["step"] += 1
            beta1, beta2 = h["betas"]
            fused([master.data], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [],
                  [torch.tensor(float(state["step"]))], lr=h["lr"], beta1=beta1, beta2=beta2,
                  weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False, maximize=False,
                  grad_scale=grad_scale, found_inf=None)
            if uploaded is not None:
                uploaded.synchronize()  # the last upload may still be reading the staging buffer
            opt.param_buffer_of_bit16_for_cpu_offload_groups[i].data.copy_(master.data)

    # -- applying the pending update ------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for the pending update, upload its weights and gather them (a no-op when none is pending)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()  # re-raises what the thread raised
        from deepspeed.runtime.utils import all_gather_dp_groups
        import deepspeed.comm as dist

        opt = self.opt
        for i in range(len(opt.bit16_groups)):
            partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
            opt.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(
                opt.param_buffer_of_bit16_for_cpu_offload_groups[i].data, non_blocking=True)
        if torch.cuda.is_available() and opt.parallel_partitioned_bit16_groups[0][0].is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                             partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                             dp_process_group=opt.real_dp_process_group,
                             start_alignment_factor=opt.nccl_start_alignment_factor,
                             allgather_bucket_size=opt.allgather_bucket_size)
        for i in range(len(opt.bit16_groups)):
            opt._update_model_bit16_weights(i)
        opt._lazy_init_hp_params_optimizer_state()

    def close(self) -> None:
        """Apply what is pending, stop the thread and give DeepSpeed its own step back."""
        try:
            self.sync()
        finally:
            self._pool.shutdown(wait=True)
            self.opt.step = self._plain_step
