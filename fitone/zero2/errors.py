"""DeepSpeed 0.19.8's error texts that fitone acts on, matched here and nowhere else."""

from __future__ import annotations


def is_loss_scale_collapse(exc: BaseException) -> bool:
    """DeepSpeed's fp16 scaler raises a bare Exception once the scale is at its minimum and still overflows."""
    return "loss scale already at minimum" in str(exc)


def is_gradient_computed_twice(exc: BaseException) -> bool:
    """ZeRO-2's assertion when a backward finds a partition already reduced: after an out-of-memory reset that
    missed some of its bookkeeping (oom.reset_after_oom), the engine must be rebuilt."""
    return isinstance(exc, AssertionError) and "computed twice" in str(exc)
