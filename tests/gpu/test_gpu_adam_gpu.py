"""The GPU's share of the pipelined update's Adam (--gpu-adam-share, fitone.zero2.gpu_adam): its CUDA kernel gives
fitone.zero2.adam32's CPU bits, element for element, and an engine that steps half its chunks on the GPU trains
bit for bit as one that steps them all on the CPU (the states' round trip, the casts and the events included).
"""

from __future__ import annotations

import pytest
import torch
from conftest import weights
from gpu_lane import gpu_engine, masters, needs_cuda, record, train_step

from fitone.zero2 import adam32, gpu_adam

pytestmark = [pytest.mark.gpu, needs_cuda]


def states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 master and moments as training leaves them, with some of the second moment in fp32's subnormal range
    (a kernel that flushed subnormals would differ there)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g) * 0.02
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    v[::97] = torch.rand(v[::97].shape, generator=g) * 1e-39
    return p, m, v


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("weight_decay", "adam_w_mode"), [(0.0, True), (0.01, True), (0.01, False)])
@pytest.mark.parametrize("grad_scale", [None, 3.0 * 2**14])
def test_the_gpu_kernel_gives_the_cpu_ops_bits(grad_dtype, weight_decay, adam_w_mode, grad_scale):
    assert adam32.available()  # the CPU bits the share must give
    n = 2**20 + 16 * 37  # a whole number of the CPU op's lanes: every element in its vector loop
    for step in (1, 7):
        p, m, v = states(n, step)
        g = torch.Generator().manual_seed(100 + step)
        grad = (torch.randn(n, generator=g) * (grad_scale or 1.0) * 1e-2)
        grad[::89] *= 1e-30  # subnormal and tiny gradients too
        grad = grad.to(grad_dtype)
        hyper = dict(step=step, lr=2e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                     grad_scale=grad_scale, adam_w_mode=adam_w_mode)
        on_gpu = [t.cuda() for t in (p, m, v)]
        adam32.adamw(p, m, v, grad, **hyper)
        gpu_adam.adamw(*on_gpu, grad.cuda(), **hyper)
        torch.cuda.synchronize()
        for name, want, got in zip(("master", "exp_avg", "exp_avg_sq"), (p, m, v), on_gpu):
            differ = int((want != got.cpu()).sum())
            assert differ == 0, f"{name}: {differ} of {n} elements differ at step {step}"


def share_chunks(update) -> int:
    """The chunks the share steps in an update, from the chunk plan: GpuShare.takes over the update's order (every
    group's chunks, the speculated ones counted in the order but left to the CPU)."""
    share, ordinal, taken = update.gpu_share, 0, 0
    for i, ends in enumerate(update.chunks):
        for c, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
            taken += not update.speculated(i, c) and share.takes(ordinal, lo, hi)
            ordinal += 1
    return taken


@pytest.mark.parametrize(("precision", "grad_accum"), [("bf16", 1), ("bf16", 3), ("fp16", 1)])
def test_an_engine_stepping_half_its_chunks_on_the_gpu_trains_bit_for_bit_as_the_cpus(precision, grad_accum):
    """12 steps of gpt2 (four chunks, two of them the GPU's) against the pipelined update on the CPU alone. The
    clip stays at training's 1.0 (random-init gpt2 clips): the share steps at the clip's scale, as the CPU does."""
    runs = {}
    for share in (0.0, 0.5):
        engine = gpu_engine(precision, pipelined=True, grad_accum=grad_accum, gpu_share=share)
        try:
            assert (engine.overlap.gpu_share is not None) == bool(share)
            states = [engine.optimizer.optimizer.state[m] for m in engine.optimizer.single_partition_of_fp32_groups]
            if share:  # page-locked when the engine is built, not in a timed step (bar 4 of issue 29)
                assert all(s[k].is_pinned() for s in states for k in ("exp_avg", "exp_avg_sq"))
            losses = [train_step(engine, step, grad_accum) for step in range(1, 13)]
            engine.sync_weights()
            timing = dict(engine.overlap.last_timing or {})
            timing["expected_gpu_chunks"] = share_chunks(engine.overlap) if share else 0
            moments = [{k: t.clone() for k, t in engine.optimizer.optimizer.state[m].items()
                        if isinstance(t, torch.Tensor)} for m in engine.optimizer.single_partition_of_fp32_groups]
            runs[share] = losses, weights(engine), masters(engine), moments, timing
        finally:
            engine.close()
    (want_losses, want, want_masters, want_states, _), (got_losses, got, got_masters, got_states, timing) = \
        runs[0.0], runs[0.5]
    record(f"gpu_share[{precision}-accum{grad_accum}]", losses_cpu=want_losses, losses_share=got_losses,
           timing=timing)
    assert want_losses[-1] < 0.8 * want_losses[0], want_losses  # every update moves the loss
    assert timing.get("gpu_chunks") == timing["expected_gpu_chunks"] >= 1  # in the last update
    assert got_losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(got_masters, want_masters))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got_states, want_states) for k in b)
