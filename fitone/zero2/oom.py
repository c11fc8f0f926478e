"""Making a ZeRO-2 engine usable again after an out-of-memory error in backward or in the step."""

from __future__ import annotations

from typing import Any


def reset_after_oom(ds_engine: Any, opt: Any) -> None:
    """Put ZeRO-2's per-backward bookkeeping back to the start of a step and drop the reduce buckets.

    An interrupted backward leaves gradients queued in the bucket, partitions marked reduced ('Gradient
    computed twice' next time), the backward depth raised and a micro-step count that would make the next
    backward accumulate into stale host buffers. Weights and optimizer states are kept (the probe does not
    care; training stops on an OOM). tests/probe/test_probe_batch.py holds later steps to a fresh engine's.
    """
    if hasattr(opt, "_backward_hook_state"):  # the aborted backward never ran exit_backward()
        opt._backward_active_depth = 0
        opt._remaining_grad_acc_hooks = 0
    if hasattr(opt, "clear_backward_seen_flag"):
        opt.clear_backward_seen_flag()  # hook counters, and the grad_accum of the aborted backward
    opt.zero_grad(set_to_none=True)
    for bucket in getattr(opt, "ipg_buckets", {}).values():  # gradients queued for reduction
        bucket.clear()
    for name in ("extra_large_param_to_reduce", "previous_reduced_grads"):
        getattr(opt, name, {}).clear()
    reduced = getattr(opt, "params_already_reduced", [])
    for i in range(len(reduced)):
        reduced[i] = False
    if hasattr(opt, "reset_partition_gradient_structures"):
        opt.reset_partition_gradient_structures()
    if hasattr(opt, "_release_ipg_buffers"):
        opt._release_ipg_buffers()  # frees the reduce buckets on the GPU; the next backward allocates them
    for name in ("averaged_gradients", "all_grad_tensors"):
        grads = getattr(opt, name, {})
        for key in list(grads):
            grads[key] = None
    if getattr(opt, "cpu_offload", False):
        opt.reset_cpu_buffers()
        opt._offload_accumulated_param_ids = set()
    if hasattr(opt, "micro_step_id"):
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt.micro_step_id = INITIAL_MICRO_STEP_ID  # else the next backward counts as an accumulation step
    timers = getattr(getattr(ds_engine, "timers", None), "timers", {})  # only with wall_clock_breakdown
    for timer in timers.values():
        if getattr(timer, "started_", False):
            timer.started_ = False
    ds_engine.zero_grad()
