"""fitone.zero2.overflow: DeepSpeed's offload overflow check kept on the device until the step, on real ZeRO-2
CPU-offload engines (tiny T5, bf16 on the CPU, where DeepSpeed checks gradients as it does in fp16).

The speed it buys (no host sync per gradient during the GPU's backward) cannot show on a CPU; what is
proven here is that the decision is DeepSpeed's: an inf in any gradient drops the step, a clean step
applies, and the per-gradient check never asks for a tensor's truth value (the sync it removes).
"""

from __future__ import annotations

import torch

from conftest import fixed_batch, tiny_engine, weights


class NoHostSync(torch.Tensor):
    """A gradient whose truth value (a device-to-host sync on a GPU) must never be asked for."""

    def __bool__(self) -> bool:
        raise AssertionError("the overflow tracker asked for a tensor's truth value: a host sync per gradient")


def test_the_engine_defers_deepspeeds_offload_overflow_check():
    engine = tiny_engine("bf16")
    try:
        assert engine.overflow_deferred and engine.optimizer.check_grad_overflow
        engine.optimizer.update_offload_overflow_tracker(torch.zeros(8).as_subclass(NoHostSync))
        engine.optimizer.update_offload_overflow_tracker(torch.ones(8).as_subclass(NoHostSync))
    finally:
        engine.close()


def test_an_inf_in_one_gradient_drops_the_step_and_the_next_clean_step_applies():
    """The inf is put into one gradient as the backward produces it (a tensor hook), so it reaches the
    host copy and the tracker the way a real fp16/bf16 overflow does."""
    engine = tiny_engine("bf16")
    try:
        engine.backward(engine.forward(fixed_batch(0)))
        engine.optimizer._wait_for_offload_copies()
        engine.optimizer.check_overflow()
        assert not engine.optimizer.overflow
        engine.step()  # a clean first step: DeepSpeed's optimizer states now exist
        before = weights(engine)
        param = next(p for n, p in engine.module.named_parameters() if "layer.0.SelfAttention.q" in n)
        handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
        engine.backward(engine.forward(fixed_batch(1)))
        handle.remove()
        engine.optimizer._wait_for_offload_copies()
        engine.optimizer.check_overflow()  # the tracker's flag alone (the step's norm check would also see the inf)
        assert engine.optimizer.overflow
        engine.step()
        assert engine.optimizer.overflow and not engine.last_step_applied and engine.skipped_steps == 1
        assert all(torch.equal(before[k], v) for k, v in weights(engine).items())
        engine.backward(engine.forward(fixed_batch(2)))
        engine.step()
        assert not engine.optimizer.overflow and engine.last_step_applied and engine.skipped_steps == 1
        assert any(not torch.equal(before[k], v) for k, v in weights(engine).items())
    finally:
        engine.close()


def test_a_flag_left_by_an_interrupted_backward_is_cleared_with_deepspeeds_buffers():
    """reset_cpu_buffers (what DeepSpeed and fitone's OOM recovery call between steps) forgets a flag
    raised by gradients that never reached a step."""
    engine = tiny_engine("bf16")
    try:
        engine.optimizer.update_offload_overflow_tracker(torch.tensor([1.0, float("inf")]))
        engine.optimizer.reset_cpu_buffers()
        engine.backward(engine.forward(fixed_batch(0)))
        engine.step()
        assert engine.last_step_applied and engine.skipped_steps == 0
    finally:
        engine.close()


class Watched(torch.Tensor):
    """A gradient that records every torch operation run on it (reading `.data` included)."""

    ops: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.ops.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_fp32_skips_the_check_deepspeed_never_reads():
    """In fp32 DeepSpeed never reads the overflow answer: the tracker must not look at the gradient at all
    (on a GPU each look is a kernel per gradient), and keeps no flag that could drop a step."""
    engine = tiny_engine()
    try:
        assert not engine.optimizer.check_grad_overflow
        Watched.ops = []
        engine.optimizer.update_offload_overflow_tracker(torch.tensor([float("inf")]).as_subclass(Watched))
        assert Watched.ops == []
        engine.optimizer.check_overflow()  # what the flag would feed, were it kept
        assert not engine.optimizer.overflow
        before = weights(engine)
        engine.backward(engine.forward(fixed_batch(0)))
        engine.step()
        assert engine.last_step_applied and engine.skipped_steps == 0
        assert any(not torch.equal(before[k], v) for k, v in weights(engine).items())
    finally:
        engine.close()
