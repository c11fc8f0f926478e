"""The clipping norm of a ZeRO-2 CPU-offload optimizer, independent of how the model is cut into groups.

DeepSpeed 0.19.8 (`scaled_global_norm`) sums each group's squared parameter norms in double, takes each
group's square root in float32, and combines the groups with `torch.linalg.vector_norm`, whose float32
rounding follows ATen's SIMD level (AVX512, AVX2, default). With the norm above `--grad-clip` every
gradient is scaled by it, so one ulp there moved the weights of a grouped run away from a one-group run
on an AVX512 CPU and not on an AVX2 one (bench/results/2026-12-01-issue26-cpu/). Summing every group's
parameters in one double sum, as DeepSpeed does for one group, gives the one-group norm, bit for bit.
"""

from __future__ import annotations

from typing import Any


def one_sum_grad_norm(optimizer: Any) -> bool:
    """Patch a ZeRO-2 CPU-offload optimizer in place; False (untouched) for any other optimizer and for MoE
    models (DeepSpeed averages their expert groups' norms on their own)."""
    if (not getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "has_moe_layers", True)
            or not all(hasattr(optimizer, name) for name in ("complete_grad_norm_calculation_for_cpu_offload",
                                                              "params_in_partition", "scaled_global_norm"))):
        return False
    from deepspeed.runtime.utils import combine_grad_norm_groups

    def scaled_global_norm(norm_type: int = 2) -> Any:
        assert norm_type == 2, "only L2 norm supported"  # as DeepSpeed's
        params = [p for group in optimizer.params_in_partition for p in group]  # declaration order
        norm = optimizer.complete_grad_norm_calculation_for_cpu_offload(params)  # one group's arithmetic
        return combine_grad_norm_groups([norm], norm_type=norm_type)  # its invalid-norm sentinel as for one group

    optimizer.scaled_global_norm = scaled_global_norm
    return True
