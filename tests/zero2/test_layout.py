"""fitone.zero2: bounded parameter groups and the lean host layout, on real DeepSpeed ZeRO-2 CPU-offload
engines (tiny T5 on the CPU). What the CPU cannot show is measured on the GPU: the init peak and the host
bytes per parameter of a 7B model (bench/results/2026-11-30-issue19/)."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import fixed_batch, tiny_engine, weights
from fitone.zero2 import adam32, layout, overlap

pytestmark = pytest.mark.numeric  # engines compared to the bit: also run under another SIMD level (.ci/run)

SMALL_GROUPS = 20_000  # elements: cuts the tiny T5 (~1M parameters) into dozens of groups
SMALL_CHUNKS = 2048  # elements: the tiny T5's embedding (256 x 64) and feed-forward weights span several


def make_engine(precision: str = "bf16", grad_accum: int = 1, *, pipelined: bool = False, lean: bool = False,
                chunk: int | None = None):
    """conftest.tiny_engine in bf16 by default: `lean` the lean layout with no update on it, `pipelined` the
    engine's own pipelined update, `chunk` either of them in such chunks."""
    return tiny_engine(precision, grad_accum=grad_accum, pipelined=pipelined, lean=lean, chunk=chunk)


def deepspeeds_layout_pipelined(precision: str, grad_accum: int, chunk: int):
    """The reference for the lean layout: DeepSpeed's own host layout (fp32 gradient buffers, its per-parameter
    accumulation buffers and its own first step) under the same pipelined update, in the same chunks."""
    engine = make_engine(precision, grad_accum)
    engine.overlap = overlap.PipelinedUpdate(engine.optimizer, engine.module, after=1, chunk_elements=chunk)
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
    """Three micro-batches into one step: the gradients at the boundary, widened to fp32, equal DeepSpeed's
    own layout's fp32 gradients to the last bit, held in the dtype of the GPU's gradients (bf16: 2 B/param)
    with no accumulation buffer of their own, the sums carried up a chunk at a time through one chunk-sized
    buffer, and the layout's own accumulation (no host wait, no copy of the sum at the boundary, no fp32
    widening before the copy) in place of DeepSpeed's."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    grads = {}
    for lean in (False, True):
        engine = make_engine(precision, grad_accum=3, lean=lean, chunk=SMALL_CHUNKS)
        try:
            opt = engine.optimizer
            for micro in range(3):
                engine.backward(engine.forward(fixed_batch(micro)))
                if micro < 2:
                    engine.step()  # not a boundary: DeepSpeed only counts the micro-step
            assert engine.ds.is_gradient_accumulation_boundary()  # the last backward wrote the fp32 gradients
            opt._wait_for_offload_copies()
            if lean:
                host = engine.host
                grads[lean] = [g.float() for g in host.gradients]
                assert all(g.dtype == flat.dtype for g, flat in zip(host.gradients, opt.bit16_groups_flat))
                held = {t.untyped_storage().data_ptr() for t in opt.accumulated_grads_in_cpu.values()}
                buffers = {g.untyped_storage().data_ptr() for g in host.gradients}
                assert opt.accumulated_grads_in_cpu and held <= buffers  # the sums live in the gradient buffers
                for shadowed in (opt.async_accumulate_grad_in_cpu_via_gpu,  # its adds, not DeepSpeed's
                                 opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu):  # its boundary copy
                    assert "LeanHost" in shadowed.__qualname__
                largest = max(p.numel() for params in opt.bit16_groups for p in params)
                assert largest > 2 * SMALL_CHUNKS  # the sums of the largest parameters went up in 3+ chunks
                assert opt.temp_grad_buffer_for_gpu_offload.numel() == SMALL_CHUNKS  # not the largest's
            else:
                grads[lean] = [p.grad.clone() for p in opt.single_partition_of_fp32_groups]
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
        # fp32 training: DeepSpeed's fp32 gradients are the layout's, read in place (no upcast scratch)
        assert held == {"fp32 master": 4 * n, "gradients": 4 * n, "Adam moments": 8 * n, "fp32 upcast": 0}
    finally:
        lean.close()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert all(torch.allclose(got[k], expected[k], atol=1e-6, rtol=0) for k in expected)


def train_and_keep(engine, steps: int, grad_accum: int) -> tuple[list[float], dict, list, list]:
    """Every micro-batch's loss, then the module's weights, the fp32 masters and Adam's moments."""
    losses = train(engine, steps, grad_accum)
    opt = engine.optimizer
    masters = [m.detach().clone() for m in opt.single_partition_of_fp32_groups]
    moments = [opt.optimizer.state[m][k].clone() for m in opt.single_partition_of_fp32_groups
               for k in ("exp_avg", "exp_avg_sq")]
    return losses, weights(engine), masters, moments


@pytest.mark.parametrize("precision, reads_16bit", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_the_lean_layout_trains_bit_for_bit_as_deepspeeds_layout(monkeypatch, precision, reads_16bit):
    """Five steps of three micro-batches under the pipelined update, the first step DeepSpeed's arithmetic:
    every loss, the module's weights, the fp32 masters and Adam's moments equal, to the last bit, those of the
    same update on DeepSpeed's own layout (fp32 gradient buffers, its own first step), which is what the lean
    layout computed before its gradients went to 16 bits. Many groups and small chunks, so that the first
    step's chunked DeepSpeedCPUAdam, the widening in slices of a quarter chunk (Adam on each slice) and the
    chunked sums all run; clipped (norm > 1). `reads_16bit` False: the later steps widen too (fitone.zero2.adam32's
    op forced off), else they read the 16-bit gradients as they are."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    monkeypatch.setattr(adam32, "ENABLED", reads_16bit)
    plain = deepspeeds_layout_pipelined(precision, grad_accum=3, chunk=SMALL_CHUNKS)
    try:
        want = train_and_keep(plain, 5, grad_accum=3)
        assert float(plain.optimizer._global_grad_norm) > 1.0  # the clip factor was part of every update
    finally:
        plain.close()
    lean = make_engine(precision, grad_accum=3, pipelined=True, chunk=SMALL_CHUNKS)
    try:
        assert lean.overlap.host is lean.host and lean.overlap.applied == 0
        assert len(lean.optimizer.bit16_groups) > 10 and max(len(ends) for ends in lean.overlap.chunks) > 2
        widened, widen = [], lean.host.fp32_gradient
        monkeypatch.setattr(lean.host, "fp32_gradient", lambda i, lo, hi: widened.append(hi - lo) or widen(i, lo, hi))
        got = train_and_keep(lean, 5, grad_accum=3)
        assert lean.overlap.applied == 5
        if precision == "bf16":  # widened a slice at a time, never a chunk at once: the first step, or every one
            assert lean.host.widens and lean.host.widen_elements == SMALL_CHUNKS // 4
            chunks = sum(map(len, lean.overlap.chunks))
            assert lean.overlap.reads_16bit == reads_16bit and max(widened) == SMALL_CHUNKS // 4
            assert chunks < len(widened) <= 4 * chunks if reads_16bit else len(widened) > 5 * chunks
        else:
            assert not lean.host.widens  # fp32 gradients are Adam's as they are
    finally:
        lean.close()
    losses, module, masters, moments = got
    assert losses == want[0] and len(losses) == 15
    assert all(torch.equal(module[k], want[1][k]) for k in want[1])
    assert all(torch.equal(a, b) for a, b in zip(masters + moments, want[2] + want[3]))
    assert losses[-1] < losses[0]


def fp32_group_sized(opt, before: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """Live fp32 host tensors as large as some parameter group, other than the masters and Adam's moments:
    where a whole fp32 gradient of a group would be (made in Python, alive now). Parameters (a gradient
    buffer is none) and the tensors alive before the engine was built (`before`: ids; other tests' models
    may still be alive in the suite's process) are not counted."""
    masters = opt.single_partition_of_fp32_groups
    sizes = {m.numel() for m in masters}
    known = {t.untyped_storage().data_ptr() for m in masters
             for t in [m.data] + [v for v in opt.optimizer.state[m].values() if isinstance(v, torch.Tensor)]}
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and not isinstance(t, torch.nn.Parameter) and id(t) not in before
            and not t.is_meta and t.numel() in sizes and t.untyped_storage().data_ptr() not in known]


def live_tensor_ids() -> frozenset[int]:
    gc.collect()
    return frozenset(id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor))


def test_the_lean_layout_holds_sixteen_bit_gradients_and_nothing_the_size_of_the_largest_parameter(monkeypatch):
    """bf16: master 4 + gradients 2 + moments 8 B/param and one fp32 chunk, before, through and after the
    first step (DeepSpeed's arithmetic, which on DeepSpeed's layout reads a whole fp32 gradient per group),
    counted from the live tensors, not only from what host_bytes() says. DeepSpeed's buffers sized for the
    largest parameter or group (its 16-bit weight staging, its host gradient buffer, its GPU buffer for the
    sums) are released or cut to one chunk, and its own step, which would need them, is refused."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    before = live_tensor_ids()
    engine = make_engine("bf16", grad_accum=2, pipelined=True, chunk=SMALL_CHUNKS)
    try:
        opt, host = engine.optimizer, engine.host
        masters = opt.single_partition_of_fp32_groups
        n = sum(m.numel() for m in masters)
        assert all(m.grad is None for m in masters) and fp32_group_sized(opt, before) == []
        assert opt.temp_grad_buffer_for_gpu_offload.numel() == SMALL_CHUNKS
        assert opt.temp_grad_buffer_for_cpu_offload.numel() == 0
        assert all(b.numel() == 0 for b in opt.param_buffer_of_bit16_for_cpu_offload_groups)
        with pytest.raises(RuntimeError, match="DeepSpeed's own step cannot run on the lean host layout"):
            engine.overlap._plain_step()  # DeepSpeed's step as the layout leaves it
        seen = []  # what is alive halfway through the first step's Adam, looked at from inside it
        widen = host.fp32_gradient

        def looking(i, lo, hi):
            if i == len(masters) // 2 and lo == 0:
                seen.append(fp32_group_sized(opt, before))
            return widen(i, lo, hi)

        monkeypatch.setattr(host, "fp32_gradient", looking)
        train(engine, 1, grad_accum=2)  # the first step: DeepSpeed's arithmetic, on these buffers
        assert engine.overlap.applied == 1 and seen == [[]]
        monkeypatch.setattr(host, "fp32_gradient", widen)
        train(engine, 2, grad_accum=2)  # pipelined steps
        assert fp32_group_sized(opt, before) == []
        assert host.host_bytes() == {"fp32 master": 4 * n, "gradients": 2 * n, "Adam moments": 8 * n,
                                     "fp32 upcast": 4 * SMALL_CHUNKS // 4}  # one widened slice
    finally:
        engine.close()


def test_a_lean_checkpoint_resumes_on_either_layout_bit_for_bit(tmp_path, monkeypatch):
    """bf16, two micro-batches a step: saved from the lean layout after 3 steps, resumed into the lean layout
    (DeepSpeed relinks its per-parameter gradient views after a load: onto the 16-bit buffers here) and into
    DeepSpeed's own layout: the next 2 steps' losses and the weights are the same, bit for bit."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    saved = make_engine("bf16", grad_accum=2, pipelined=True, chunk=SMALL_CHUNKS)
    try:
        train(saved, 3, grad_accum=2)
        saved.save(str(tmp_path), "step-3", {})
    finally:
        saved.close()
    resumed = {}
    for lean in (True, False):
        engine = (make_engine("bf16", grad_accum=2, pipelined=True, chunk=SMALL_CHUNKS) if lean
                  else deepspeeds_layout_pipelined("bf16", grad_accum=2, chunk=SMALL_CHUNKS))
        try:
            engine.load(str(tmp_path), "step-3")
            assert engine.overlap.applied == 3  # the resumed steps are pipelined, as they would have been
            if lean:
                views = {v.untyped_storage().data_ptr() for vs in engine.optimizer.offload_gradient_dict.values()
                         for v in vs}
                assert views and views <= {g.untyped_storage().data_ptr() for g in engine.host.gradients}
            torch.manual_seed(1)
            resumed[lean] = (train(engine, 2, grad_accum=2), weights(engine))
        finally:
            engine.close()
    assert resumed[True][0] == resumed[False][0]
    assert all(torch.equal(resumed[True][1][k], resumed[False][1][k]) for k in resumed[False][1])

def test_gradients_summed_in_another_dtype_keep_deepspeeds_step():
    """The lean layout holds the gradients in the weights' dtype, the one DeepSpeed sums them in: a
    --ds-config that has them summed in fp32 (data_types.grad_accum_dtype) takes DeepSpeed's step by
    default and refuses --pipelined-update in one line, before any engine exists."""
    from fitone.errors import ConfigError
    from fitone.zero2.step_mode import DEEPSPEED, PIPELINED, decide

    ds = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    flags = dict(delayed_update=False, delayed_update_after=0, world_size=1, on_gpu=True)
    fp32_sums = {**ds, "data_types": {"grad_accum_dtype": "fp32"}}
    bf16_sums = {**ds, "data_types": {"grad_accum_dtype": "bfloat16"}}  # DeepSpeed's name for the weights' dtype
    assert decide(ds, pipelined_update=None, **flags).name == PIPELINED
    assert decide(bf16_sums, pipelined_update=None, **flags).name == PIPELINED
    assert decide(fp32_sums, pipelined_update=None, **flags).name == DEEPSPEED
    with pytest.raises(ConfigError, match=r"--pipelined-update keeps the gradients .*drop data_types.grad_accum_dtype"):
        decide(fp32_sums, pipelined_update=True, **flags)


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


def test_a_gradient_larger_than_a_norm_chunk_is_normed_in_pieces_within_fp64_rounding(monkeypatch):
    """A gradient larger than NORM_CHUNK_ELEMENTS is normed a piece at a time (no fp64 copy of the whole
    parameter on the GPU): each per-parameter norm within the fp64 rounding of two sums of n squares
    (2 n eps64 relative), and the total norm, which DeepSpeed rounds to fp32, the same fp32 number here."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    norms = {}
    for pieces in (False, True):
        if pieces:
            monkeypatch.setattr(layout, "NORM_CHUNK_ELEMENTS", 1000)
        engine = make_engine("bf16", grad_accum=2, pipelined=True, chunk=SMALL_CHUNKS)
        opt, seen = engine.optimizer, {}
        norm = opt.set_norm_for_param_grad_in_gpu

        def recording(param, norm=norm, opt=opt, seen=seen):  # the step clears them: keep each as it is made
            norm(param)
            seen[opt.get_param_id(param)] = float(opt.norm_for_param_grads[opt.get_param_id(param)])

        opt.set_norm_for_param_grad_in_gpu = recording
        try:
            train(engine, 2, grad_accum=2)
            norms[pieces] = (seen, float(opt._global_grad_norm))
            sizes = {engine.optimizer.get_param_id(p): p.numel() for p in engine.module.parameters()}
        finally:
            engine.close()
    (whole, total_whole), (split, total_split) = norms[False], norms[True]
    assert any(sizes[k] > 1000 for k in split)  # some parameters were normed in pieces
    eps64 = torch.finfo(torch.float64).eps
    for k, v in whole.items():
        assert abs(split[k] - v) <= 2 * sizes[k] * eps64 * v, (k, split[k], v)
    assert torch.tensor(total_split, dtype=torch.float32) == torch.tensor(total_whole, dtype=torch.float32)


def test_no_fp64_copy_of_a_gradient_larger_than_a_norm_chunk_is_made(monkeypatch):
    """What normed in pieces saves: DeepSpeed widens each parameter's whole gradient to fp64 for its norm (8 B
    an element, on the GPU), the lean layout a piece at a time. bf16, two micro-batches, pieces of 2048
    elements: every fp64 tensor made in the boundary's backward is at most a piece on the lean layout, and the
    size of the largest parameter on DeepSpeed's (what the instrument sees there, so it sees those copies)."""
    monkeypatch.setattr(layout, "GROUP_ELEMENTS", SMALL_GROUPS)
    monkeypatch.setattr(layout, "NORM_CHUNK_ELEMENTS", SMALL_CHUNKS)
    widened = []  # elements of every fp64 tensor Tensor.to makes while the instrument is in
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype == torch.float64:
            widened.append(out.numel())
        return out

    widest = {}
    for lean in (False, True):
        engine = make_engine("bf16", grad_accum=2, lean=lean, chunk=SMALL_CHUNKS)
        try:
            engine.backward(engine.forward(fixed_batch(0)))
            engine.step()  # not a boundary
            widened.clear()
            monkeypatch.setattr(torch.Tensor, "to", to)
            engine.backward(engine.forward(fixed_batch(1)))  # the boundary: the norms are taken here
            monkeypatch.setattr(torch.Tensor, "to", real_to)
            widest[lean] = max(widened)
            largest = max(p.numel() for params in engine.optimizer.bit16_groups for p in params)
        finally:
            engine.close()
    assert widest[False] == largest > 2 * SMALL_CHUNKS and widest[True] <= SMALL_CHUNKS
