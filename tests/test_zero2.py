"""fitone.zero2: bounded parameter groups and the lean host layout, on real DeepSpeed ZeRO-2 CPU-offload
engines (tiny T5 on the CPU). What the CPU cannot show is measured on the GPU: the init peak and the host
bytes per parameter of a 7B model (bench/results/2026-11-30-issue19/)."""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_config, fixed_batch, weights
from fitone.zero2 import layout

pytestmark = pytest.mark.numeric  # engines compared to the bit: also run under another SIMD level (.ci/run)

SMALL_GROUPS = 20_000  # elements: cuts the tiny T5 (~1M parameters) into dozens of groups


def make_engine(precision: str = "bf16", grad_accum: int = 1, *, pipelined: bool = False, lean: bool = False):
    """A seeded tiny-T5 engine; `lean` builds DeepSpeed's step on the lean layout (only to compare gradients:
    DeepSpeed's own step needs the staging copy the layout releases)."""
    from fitone.ds_config import build_ds_config
    from fitone.engine import Engine
    from fitone.runtime import start_runtime
    from fitone.models import build_model, load_config

    cfg = cpu_config(precision=precision, lr=1e-3, lr_schedule="constant", warmup_steps=0, grad_accum=grad_accum)
    start_runtime(cfg)
    torch.manual_seed(0)
    model = build_model(load_config("t5-tiny", from_scratch=True))
    ds = build_ds_config(cfg, micro_batch=4, world_size=1, total_steps=100, on_gpu=False)
    if lean:
        ds = layout.lean_offload_config(ds)
    engine = Engine(model, ds, pipelined=pipelined)
    if lean:
        engine.host = layout.LeanHost(engine.optimizer)
    return engine


def train(engine, steps: int, grad_accum: int = 1) -> list[float]:
    losses = []
    for step in range(1, steps + 1):
        for micro in range(grad_accum):
            loss = engine.forward(fixed_batch(100 * step + micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    engine.sync_weights()
    return losses


def test_groups_are_consecutive_bounded_and_a_large_tensor_stands_alone():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(100, 100), torch.nn.Linear(3, 3))
    model[2].bias.requires_grad_(False)
    groups = layout.param_groups(model, max_elements=200)
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    assert sizes == [[100, 10], [10000], [100, 9]]  # the 10k weight alone; the frozen bias left out
    flat = [p for g in groups for p in g["params"]]
    assert flat == [p for p in model.parameters() if p.requires_grad]  # declaration order kept


def test_many_groups_train_bit_for_bit_as_one(monkeypatch):
    """Same settings in every group, Adam elementwise, the norm summed over the same parameters in the same
    order: cutting the model into groups changes nothing, to the last bit (bf16 weights, fp32 master)."""
    one = make_engine()
    try:
        assert len(one.optimizer.bit16_groups) == 1
        losses_one = train(one, 6)
        expected = weights(one)
    finally:
        one.close()
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    many = make_engine()
    try:
        assert len(many.optimizer.bit16_groups) > 10
        losses_many = train(many, 6)
        got = weights(many)
    finally:
        many.close()
    assert losses_many == losses_one
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_lean_layout_accumulates_in_the_gradient_buffer_bit_for_bit(monkeypatch, precision):
    """Three micro-batches into one step: the fp32 gradients at the boundary equal DeepSpeed's own layout's
    to the last bit, with no accumulation buffer of its own, one group's staging buffer on the host, and
    the layout's own accumulation (no host wait, no copy of the sum at the boundary) in place of DeepSpeed's."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    grads = {}
    for lean in (False, True):
        engine = make_engine(precision, grad_accum=3, lean=lean)
        try:
            opt = engine.optimizer
            for micro in range(3):
                engine.backward(engine.forward(fixed_batch(micro)))
                if micro < 2:
                    engine.step()  # not a boundary: DeepSpeed only counts the micro-step
            assert engine.ds.is_gradient_accumulation_boundary()  # the last backward wrote the fp32 gradients
            opt._wait_for_offload_copies()
            grads[lean] = [p.grad.clone() for p in opt.single_partition_of_fp32_groups]
            if lean:
                held = {t.untyped_storage().data_ptr() for t in opt.accumulated_grads_in_cpu.values()}
                buffers = {p.grad.untyped_storage().data_ptr() for p in opt.single_partition_of_fp32_groups}
                assert opt.accumulated_grads_in_cpu and held <= buffers  # the sums live in the gradient buffers
                assert "LeanHost" in opt.async_accumulate_grad_in_cpu_via_gpu.__qualname__  # its adds, not DeepSpeed's
                staging = engine.host.host_bytes()["16-bit staging"]  # one group's worth, shared by all
                flat = opt.bit16_groups_flat
                assert staging == max(b.numel() for b in flat) * flat[0].element_size()
            else:
                assert all(t.untyped_storage().data_ptr() not in
                           {p.grad.untyped_storage().data_ptr() for p in opt.single_partition_of_fp32_groups}
                           for t in opt.accumulated_grads_in_cpu.values())
        finally:
            engine.close()
    assert len(grads[True]) == len(grads[False]) > 1
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    assert any(a.abs().sum() > 0 for a in grads[True])


def test_the_pipelined_update_on_the_lean_layout_follows_deepspeeds_step_with_accumulation(monkeypatch):
    """fp32, many groups, two micro-batches a step: every loss and every weight as DeepSpeed's own step.
    Tolerance: the two Adam kernels (PyTorch's fused AdamW, DeepSpeedCPUAdam) may round an update's last bit
    differently; after 8 steps of lr 1e-3 updates that is far below 1e-6 on weights of size ~1 (fp32 eps
    1.2e-7), so 1e-6 absolute on weights and 1e-5 relative on losses separate rounding from any real error
    (one skipped or doubled micro-batch moves the losses by >1e-3)."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    plain = make_engine("fp32", grad_accum=2)
    try:
        expected_losses = train(plain, 8, grad_accum=2)
        expected = weights(plain)
    finally:
        plain.close()
    lean = make_engine("fp32", grad_accum=2, pipelined=True)
    try:
        assert lean.host is not None
        losses = train(lean, 8, grad_accum=2)
        got = weights(lean)
        held = lean.host.host_bytes()
        n = sum(p.numel() for p in lean.optimizer.single_partition_of_fp32_groups)
        largest = max(p.numel() for p in lean.optimizer.single_partition_of_fp32_groups)
        assert held == {"fp32 master": 4 * n, "fp32 gradients": 4 * n, "Adam moments": 8 * n,
                        "16-bit staging": 4 * largest}  # fp32 run: the staging buffer is fp32 too
    finally:
        lean.close()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert all(torch.allclose(got[k], expected[k], atol=1e-6, rtol=0) for k in expected)


def test_another_deepspeed_version_is_refused_in_one_line(monkeypatch):
    import deepspeed

    from fitone.errors import DeviceError
    from fitone.zero2 import check_version

    check_version()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(DeviceError, match=r"pip install deepspeed==0\.19\.8"):
        check_version()


SIMD_WIDTH = 16  # DeepSpeedCPUAdam's widest vector (AVX512): a group's last size % 16 elements take its scalar tail


def _resume(path, tag, groups: int | None, monkeypatch) -> tuple[list[float], dict, list[float]]:
    """The losses, weights and clipping norms of 3 steps resumed from `tag` under `groups`."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", groups or 2**27)
    engine = make_engine()
    try:
        # CPU Adam's scalar tail rounds apart from its vector body (bench/results/2026-12-01-issue26-cpu/):
        # bit for bit across layouts needs every group whole in the body, as the tiny T5's groups are
        assert all(p.numel() % SIMD_WIDTH == 0 for p in engine.optimizer.single_partition_of_fp32_groups)
        engine.load(str(path), tag)
        losses, norms = [], []
        for step in range(1, 4):  # train(engine, 3)'s batches, with each step's norm (above --grad-clip here)
            loss = engine.forward(fixed_batch(100 * step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(float(engine.optimizer._global_grad_norm))
        engine.sync_weights()
        return losses, weights(engine), norms
    finally:
        engine.close()


def test_a_checkpoint_resumes_across_the_one_group_and_the_grouped_layouts(tmp_path, monkeypatch):
    """Saved in one group (as fitone saved every model before bounded groups), resumed into dozens, and
    back: the continued losses, clipping norms and weights are those of resuming into the layout it was
    saved in, bit for bit (the optimizer state is moved parameter by parameter, by name; the norm is one
    sum over all groups, fitone.zero2.grad_norm: DeepSpeed's own per-group combination rounds by ATen's
    SIMD level, and moved 2 of 47 bf16 weights by one ulp on an AVX512 CPU)."""
    for saved_groups, other in ((None, SMALL_GROUPS), (SMALL_GROUPS, None)):
        monkeypatch.setattr(layout, "GROUP_ELEMENTS", saved_groups or 2**27)
        engine = make_engine()
        try:
            train(engine, 3)
            engine.save(str(tmp_path), f"saved-{saved_groups}", {})
        finally:
            engine.close()
        same = _resume(tmp_path, f"saved-{saved_groups}", saved_groups, monkeypatch)
        across = _resume(tmp_path, f"saved-{saved_groups}", other, monkeypatch)
        assert across[0] == same[0]
        assert across[2] == same[2] and min(same[2]) > 1.0  # the norms, to the bit; clipping ran on each step
        assert all(torch.equal(across[1][k], same[1][k]) for k in same[1])
