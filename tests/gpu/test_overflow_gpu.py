"""fp16 overflow on the GPU: a step whose gradients hold an inf is dropped by the pipelined update exactly
as DeepSpeed's own step drops it, with fitone's deferred overflow check (fitone.zero2.overflow) reading a real
device flag. tests/zero2/test_overflow.py shows the decision on the CPU in bf16 (DeepSpeed refuses fp16 there).
"""

from __future__ import annotations

import pytest
import torch
from conftest import weights
from gpu_lane import gpu_engine, masters, needs_cuda, record, train_step

pytestmark = [pytest.mark.gpu, needs_cuda]

APPLIED_FIRST = 2  # clean steps applied before the overflows: DeepSpeed's own first, then a pipelined one
INF_STEPS = 2  # in a row: with DeepSpeed's hysteresis of 2, the first overflow of a run leaves the scale


def overflow_run(pipelined: bool) -> dict:
    """Clean steps, then two with an inf put into one gradient as the backward makes it (a tensor hook on a
    GPU parameter, so it reaches the reduce hooks, the host copy and the overflow flag as a real overflow
    does), then a clean step. Returns what the steps did; asserts what must hold on each engine alone."""
    engine = gpu_engine("fp16", pipelined=pipelined)
    try:
        step = 0
        while engine.ds.global_steps - engine.skipped_steps < APPLIED_FIRST:  # fp16's scale may settle first
            step += 1
            assert step <= 10, "fp16 kept overflowing from the first step: no clean steps to compare"
            train_step(engine, step)
        if pipelined:  # the next steps take the pipelined update's own overflow decision, not DeepSpeed's step
            assert engine.overlap.applied >= engine.overlap.after
        engine.sync_weights()
        before, before_masters = weights(engine), masters(engine)
        adam = engine.optimizer.optimizer
        state = adam.state[engine.optimizer.single_partition_of_fp32_groups[0]]
        adam_step, exp_avg = state["step"], state["exp_avg"].clone()
        scale, hysteresis = engine.loss_scale, engine.optimizer.loss_scaler.cur_hysteresis
        skipped = engine.skipped_steps
        param = next(p for n, p in engine.module.named_parameters() if n.endswith("h.0.attn.c_attn.weight"))
        assert param.is_cuda
        handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
        scales = []
        try:
            for _ in range(INF_STEPS):
                step += 1
                train_step(engine, step)
                assert not engine.last_step_applied
                scales.append(engine.loss_scale)
        finally:
            handle.remove()
        engine.sync_weights()
        assert engine.skipped_steps == skipped + INF_STEPS
        # nothing of the dropped steps reached the weights, the masters or Adam's state
        assert all(torch.equal(before[k], v) for k, v in weights(engine).items())
        assert all(torch.equal(a, b) for a, b in zip(before_masters, masters(engine)))
        assert state["step"] == adam_step and torch.equal(state["exp_avg"], exp_avg)
        # DeepSpeed's rule: halve per overflow, except the run's first while its hysteresis (2) is unspent
        halvings = INF_STEPS - (1 if hysteresis == 2 else 0)
        assert scales[-1] == scale / 2**halvings
        train_step(engine, step + 1)
        assert engine.last_step_applied  # training goes on
        engine.sync_weights()
        assert any(not torch.equal(before[k], v) for k, v in weights(engine).items())
        return {"scales": [scale, *scales, engine.loss_scale], "hysteresis": hysteresis,
                "skipped": engine.skipped_steps}
    finally:
        engine.close()


def test_an_fp16_overflow_is_dropped_by_the_pipelined_update_as_deepspeed_drops_it():
    deepspeed, pipelined = overflow_run(pipelined=False), overflow_run(pipelined=True)
    record("fp16_overflow", deepspeed=deepspeed, pipelined=pipelined)
    assert pipelined == deepspeed  # the same skips and the same loss scale after every step
