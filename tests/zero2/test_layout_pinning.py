"""fitone.zero2.layout's page-locking, on the CPU: what the lean host layout asks DeepSpeed for, what it releases,
and which buffers it registers with CUDA.

Without an accelerator PyTorch has no pinned allocator (`pin_memory=True` raises), so no buffer can be
page-locked here and `is_pinned()` is False whatever the code does: these tests check the decisions instead.
The GPU lane (tests/gpu/test_pipelined_update_gpu.py, test_train_gpu.py) checks `is_pinned()` itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import cpu_config, tiny_engine
from fitone.zero2 import layout


def lean_engine(pipelined: bool):
    """A seeded tiny-T5 engine on the lean layout's DeepSpeed config as a GPU run gets it (pin_memory: true): with
    the pipelined update (the Engine builds its LeanHost) or without (the test builds one)."""
    return tiny_engine("bf16", gpu_ds_config=True, pipelined=pipelined, lean=not pipelined, lean_host=False)


@pytest.fixture
def small_groups(monkeypatch):
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", 20_000)  # the tiny T5 in dozens of groups


def test_the_lean_layout_has_deepspeed_allocate_plain_memory_and_registers_nothing_without_cuda(small_groups):
    """DeepSpeed's own pinned blocks are rounded up to a power of two: the layout turns them off (even where the
    config asked for them, as on a GPU) and locks the pages it needs itself; DeepSpeed's staging buffers, which
    only its own step reads, are released. The sums between micro-batches live in the layout's gradient buffers
    (what it would register). On the CPU nothing is registered."""
    engine = lean_engine(pipelined=True)
    try:
        opt = engine.optimizer
        assert engine.ds_config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
        assert opt.cpu_offload and opt.cpu_offload_pin_memory is False
        assert len(opt.bit16_groups_flat) > 10
        assert all(b.numel() == 0 for b in opt.param_buffer_of_bit16_for_cpu_offload_groups)
        assert opt.temp_grad_buffer_for_cpu_offload.numel() == 0
        host = engine.host
        assert host is not None and len(host.gradients) == len(opt.single_partition_of_fp32_groups)
        assert all(g.dtype == torch.bfloat16 for g in host.gradients)  # the 16 bits DeepSpeed sums in
        sums = {t.untyped_storage().data_ptr() for t in opt.accumulated_grads_in_cpu.values()}
        assert sums <= {g.untyped_storage().data_ptr() for g in host.gradients}
        assert host._registered == []  # no CUDA: nothing to register
    finally:
        engine.close()


def test_on_a_gpu_exactly_the_fp32_master_and_gradient_buffers_are_registered(small_groups, monkeypatch):
    """FAKED: the weights' device (a stand-in for the first flat 16-bit buffer says is_cuda) and the CUDA call
    (recorded, not made). What the GPU copies touch is registered, once each and in place: every group's fp32
    master (the uploads read it) and gradient buffer (the gradients and the sums between micro-batches land
    there). Not the fp32 scratch chunk Adam widens into, nothing twice, nothing else."""
    engine = lean_engine(pipelined=False)
    opt = engine.optimizer
    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(layout.LeanHost, "_register",
                        lambda self, t: registered.append((t.data_ptr(), t.numel() * t.element_size())))
    flat = opt.bit16_groups_flat
    try:
        opt.bit16_groups_flat = [SimpleNamespace(is_cuda=True, dtype=flat[0].dtype), *flat[1:]]
        try:
            host = layout.LeanHost(opt)
        finally:
            opt.bit16_groups_flat = flat
        masters = opt.single_partition_of_fp32_groups
        expected = [(t.data_ptr(), t.numel() * t.element_size()) for m, g in zip(masters, host.gradients)
                    for t in (m.data, g)]
        assert registered == expected and len(set(registered)) == 2 * len(masters) > 20
        assert sum(size for _, size in registered) == 6 * sum(m.numel() for m in masters)  # 4 + 2 B/param
        assert host._upcast.data_ptr() not in {ptr for ptr, _ in registered}
    finally:
        engine.close()


def test_the_lean_layout_refuses_deepspeeds_pinned_buffers():
    """Built on DeepSpeed's pinned (power-of-two) buffers the layout would double-lock them: refused."""
    from fitone.ds_config import build_ds_config
    from fitone.engine import Engine
    from fitone.models import build_model, load_config
    from fitone.run import resolve_planned, start_runtime

    cfg = cpu_config(precision="bf16")
    start_runtime(cfg)
    model = build_model(load_config("t5-tiny", from_scratch=True))
    engine = Engine(model, build_ds_config(resolve_planned(cfg.replace(device="auto"), 1).with_batch(4).with_steps(10)))
    try:
        assert engine.optimizer.cpu_offload_pin_memory
        with pytest.raises(ValueError, match="pin_memory false"):
            layout.LeanHost(engine.optimizer)
    finally:
        engine.close()
