"""The one-step delayed parameter update (experimental, `--delayed-update`): ZeRO-2's CPU-offload step N runs in
a background thread beside step N+1's forward and backward, whose gradients are therefore taken at weights one
update old; it trains worse (README). The overflow, loss scale and norm are decided as in fitone.zero2.overlap.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fitone.zero2.overlap import OverlappedStep


class DelayedUpdate(OverlappedStep):
    """One-step delayed parameter update: step N's update runs beside step N+1's forward and backward."""

    name = "delayed update"

    def __init__(self, optimizer: Any, *, after: int):
        super().__init__(optimizer, after=after)
        self.spare: list[torch.Tensor] | None = None  # the second gradient buffer per group, made on first use
        self._uploaded: Any = None  # a CUDA event after the last upload: the staging buffers are free after it

    def _launch(self, norm: torch.Tensor | None, hyper: list[dict[str, Any]]) -> None:
        self.sync()  # step N-1's weights go up now; the GPU then runs step N+1 while the CPU does step N
        scale = self._combined_scale(norm)
        grads = self._swap_gradient_buffers()
        self._release_step_buffers()
        steps = [self._next_step(i) for i in range(len(grads))]
        self._wait_s = 0.0
        self.pending = self._pool.submit(self._cpu_update, grads, scale, hyper, steps, self._uploaded)

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
                    steps: list[int], uploaded: Any) -> dict[str, float]:
        """Adam, then the 16-bit staging copy (background thread); returns its timing."""
        opt = self.opt
        start = time.perf_counter()
        adam_s = 0.0
        for i, grad in enumerate(grads):
            t0 = time.perf_counter()
            self._adam(i, grad, scale, hyper[i], steps[i])
            adam_s += time.perf_counter() - t0
            if uploaded is not None:
                uploaded.synchronize()  # the last upload may still be reading the staging buffer
            opt.param_buffer_of_bit16_for_cpu_offload_groups[i].data.copy_(opt.single_partition_of_fp32_groups[i].data)
        return {"adam_s": adam_s, "thread_s": time.perf_counter() - start}

    def sync(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        timing = self._result(pending)
        self.last_timing = {**timing, "wait_s": self._wait_s}
        from deepspeed.runtime.utils import all_gather_dp_groups
        import deepspeed.comm as dist

        opt = self.opt
        for i in range(len(opt.bit16_groups)):
            partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
            opt.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(
                opt.param_buffer_of_bit16_for_cpu_offload_groups[i].data, non_blocking=True)
        if opt.parallel_partitioned_bit16_groups[0][0].is_cuda:
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
