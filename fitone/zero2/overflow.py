"""DeepSpeed's ZeRO-2 offload overflow check, with one host sync per step instead of one per gradient.

In deepspeed 0.19.8 the backward's reduce hooks copy each gradient to the host and, just before,
call `update_offload_overflow_tracker(grad)`, which does `if has_inf_or_nan(grad):` — the truth value
of a GPU tensor, so the CPU waits for the GPU at every parameter. The backward cannot be queued ahead,
and the gradient copies (on the reduction stream, behind that check) run one after another instead of
beside the backward's compute: in the harness's split the gradient transfer (0.31 s of a t5-3b step
at micro-batch 64 and 256 on an H200) adds in full to the backward's compute (bench/NOTES.md). The
check is done even where its answer is never read (fp32, and bf16 unless `check_grad_overflow`).

`defer_overflow_check` keeps the per-gradient check on the device, OR-ed into one flag, and turns the
flag into `local_overflow` where DeepSpeed reads it (`check_overflow`, at the step, after the host
copies are complete): the same decision on the same gradients; an overflowed step is still dropped.
"""

from __future__ import annotations

from typing import Any

import torch


def defer_overflow_check(optimizer: Any) -> bool:
    """Patch a ZeRO-2 CPU-offload optimizer in place; returns False (untouched) for any other optimizer."""
    if not getattr(optimizer, "cpu_offload", False) or not all(
            hasattr(optimizer, name) for name in ("update_offload_overflow_tracker", "check_overflow",
                                                  "reset_cpu_buffers", "local_overflow")):
        return False
    from deepspeed.runtime.utils import has_inf_or_nan

    found: torch.Tensor | None = None  # a device flag: any inf/NaN in this step's gradients so far
    plain_check, plain_reset = optimizer.check_overflow, optimizer.reset_cpu_buffers

    def update_offload_overflow_tracker(grad: torch.Tensor | None) -> None:
        nonlocal found
        if grad is None or not optimizer.check_grad_overflow:  # nobody reads the answer: skip the work
            return
        flag = has_inf_or_nan(grad.data)  # a device scalar: no sync
        found = flag if found is None else torch.logical_or(found, flag)

    def check_overflow(partition_gradients: bool = True) -> Any:
        nonlocal found
        if found is not None:  # the step has waited for the gradient copies, and the flags come before them
            flag, found = found, None
            if bool(flag):  # the one sync of the step
                optimizer.local_overflow = True
        return plain_check(partition_gradients)

    def reset_cpu_buffers() -> None:
        nonlocal found
        found = None
        plain_reset()

    optimizer.update_offload_overflow_tracker = update_offload_overflow_tracker
    optimizer.check_overflow = check_overflow
    optimizer.reset_cpu_buffers = reset_cpu_buffers
    return True


def step_applied(engine: Any) -> bool:
    """Whether DeepSpeed's last optimizer step changed the weights (False after an overflow skip)."""
    return bool(getattr(engine, "_step_applied", True))
