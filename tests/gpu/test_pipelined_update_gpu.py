"""The pipelined update (fitone's default step on one GPU) on the GPU: its side stream, upload chunks and
events, pinned host buffers and overlap_comm, against DeepSpeed's own step over 20 steps of gpt2.

tests/zero2/test_overlap.py proves the arithmetic on the CPU in fp32; only here do the uploads run on a CUDA
stream beside the next forward, and only here are the weights 16-bit numbers rounded from the masters.
"""

from __future__ import annotations

import pytest
import torch
from conftest import weights
from gpu_lane import LR, gpu_engine, masters, needs_cuda, record, train_step

from fitone.zero2 import cpu_adam

pytestmark = [pytest.mark.gpu, needs_cuda]

STEPS = 20
# unit roundoff u of the 16-bit weights: half the distance from 1 to the next number (2^-p, p the
# significand's bits with the implicit one)
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def comparable(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The elements of a parameter that get a gradient in exact arithmetic: all but GPT-2's key bias. That
    one shifts every key's score for a query by the same q.b, which softmax ignores; its gradient is
    rounding noise, which Adam scales up to steps of ~lr either way in any two runs that round differently."""
    if name.endswith("attn.c_attn.bias"):  # [query | key | value]
        query, _key, value = weight.float().chunk(3)
        return torch.cat([query, value])
    return weight.float()


def run(precision: str, *, pipelined: bool, grad_accum: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """STEPS steps; returns the losses, the module's 16-bit weights at the end and the skipped steps."""
    engine = gpu_engine(precision, pipelined=pipelined, grad_accum=grad_accum)
    try:
        if pipelined:
            assert len(engine.overlap.chunks[0]) > 1  # several chunks: later ones land while the forward runs
            # DeepSpeed's Adam of the first applied steps runs in the thread with the GIL released
            assert cpu_adam.releasing_op(engine.optimizer.optimizer) is not None
        assert engine.optimizer.single_partition_of_fp32_groups[0].is_pinned()  # what the uploads read
        if pipelined:  # the lean layout's 16-bit gradients, page-locked in place: what the boundary copies write
            assert all(g.is_pinned() and g.dtype == engine.optimizer.dtype for g in engine.host.gradients)
        if pipelined and grad_accum > 1:  # the lean layout's accumulation (no host wait), not DeepSpeed's
            assert "LeanHost" in engine.optimizer.async_accumulate_grad_in_cpu_via_gpu.__qualname__
        losses = [train_step(engine, step, grad_accum) for step in range(1, STEPS + 1)]
        engine.sync_weights()
        if pipelined:
            assert engine.overlap.applied == STEPS - engine.skipped_steps
        return losses, weights(engine), engine.skipped_steps
    finally:
        engine.close()


@pytest.mark.parametrize(("precision", "grad_accum"), [("fp16", 1), ("bf16", 1), ("fp16", 3), ("bf16", 3)])
def test_the_pipelined_update_gives_deepspeeds_losses_and_weights_on_the_gpu(precision, grad_accum):
    """Tolerances, from the dtype's rounding. Both runs launch the same GPU kernels on the same batches;
    what differs first is the CPU Adam (DeepSpeedCPUAdam's SIMD loop against PyTorch's fused AdamW with the
    unscale and clip folded in), by a few fp32 roundings: the masters are a few ulp32 apart, and so the
    16-bit weights now and then one rounding apart. From then on the 16-bit gradients, each within one
    rounding (2u relative) of the other run's, feed Adam, whose step lr.m/sqrt(v) (|m/sqrt(v)| <= ~1)
    moves by at most 2u for m and 2u for sqrt(v): each step adds at most 4u.lr to an element's gap.
    - weights after N steps, each element: |a - b| <= 2u|b| (the last rounding) + 4u.lr.N; per tensor of
      n elements (triangle inequality): ||a - b|| <= 2u||b|| + 4u.lr.N.sqrt(n).
    - losses: every forward's weights are then within about one rounding of each other (lr.N ~ |w| here),
      and a forward in 16 bits does not resolve its weights finer than one rounding (it rounds each by up
      to u): each step's loss agrees to u relative. The loss is fp32 (transformers upcasts the logits), so
      u is far above its own rounding step; a bound at that step would mean bit-identical.
    A forward that read a chunk before its update landed would see weights one Adam step (~lr = 1e-3) away
    in every element of it, and every step after would take that gradient: the loss, which falls by far
    more than u per step (checked first), shows it at once, the weights by the end.
    With 3 micro-batches a step both runs add the 16-bit gradients with the same kernels in the same order
    (the lean layout's copies run without DeepSpeed's host wait): a sum read before its last copy landed
    would drop a micro-batch's gradient, a third of the step, far outside these bounds."""
    u = UNIT_ROUNDOFF[precision]
    want_losses, want, want_skipped = run(precision, pipelined=False, grad_accum=grad_accum)
    got_losses, got, got_skipped = run(precision, pipelined=True, grad_accum=grad_accum)

    assert want_losses[-1] < 0.8 * want_losses[0], want_losses  # every update moves the loss
    loss_err = max(abs(g - w) / abs(w) for g, w in zip(got_losses, want_losses))
    ratio = {}  # each tensor's gap over its bound
    for name in want:
        a, b = comparable(name, got[name]), comparable(name, want[name])
        bound = 2 * u * float(b.norm()) + 4 * u * LR * STEPS * b.numel() ** 0.5
        ratio[name] = float((a - b).norm()) / bound
    worst = max(ratio, key=ratio.get)
    record(f"pipelined_vs_deepspeed[{precision}-accum{grad_accum}]", unit_roundoff=u, max_loss_rel_err=loss_err,
           worst_weight=worst, worst_weight_gap_over_bound=ratio[worst], skipped=[want_skipped, got_skipped],
           losses_deepspeed=want_losses, losses_pipelined=got_losses)
    assert got_skipped == want_skipped  # fp16: the same steps overflowed while the loss scale settled
    assert loss_err <= u, (got_losses, want_losses)
    assert ratio[worst] <= 1, f"{worst}: gap {ratio[worst]:.3g} x its bound"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_lean_layout_is_deepspeeds_layout_bit_for_bit_on_the_gpu(precision):
    """The same pipelined update on DeepSpeed's own host layout (its pinned fp32 gradients and accumulation
    buffers, its own first step) and on the lean one (16-bit gradients page-locked in place, the sums carried
    up in chunks, the first step's DeepSpeed arithmetic chunk by chunk and uploaded as the pipelined update
    uploads), 3 micro-batches a step: the same numbers, so every loss, master and 16-bit weight the same bits.
    What only a GPU runs here: the 16-bit copies into page-locked memory, the chunked adds on the GPU, the
    first step's side-stream uploads and its cast on the GPU (DeepSpeed casts on the host). gpt2's embedding
    (38.6M elements) has its gradient norm taken by chunks on the lean side: the same to fp64 rounding, which
    DeepSpeed's rounding of the global norm to fp32 hides unless it lies within ~1e-16 of an fp32 rounding
    point (odds ~1e-9 a step); a failure here that starts with the norm is that, not a wrong sum."""
    from fitone.zero2.overlap import PipelinedUpdate

    grad_accum = 3
    runs = {}
    for lean in (False, True):
        torch.cuda.reset_peak_memory_stats()
        engine = gpu_engine(precision, pipelined=lean, grad_accum=grad_accum)
        try:
            if not lean:
                engine.overlap = PipelinedUpdate(engine.optimizer, engine.module, after=1)
            losses = [train_step(engine, step, grad_accum) for step in range(1, STEPS + 1)]
            engine.sync_weights()
            runs[lean] = (losses, weights(engine), masters(engine), engine.skipped_steps,
                          torch.cuda.max_memory_allocated() / 2**30)
        finally:
            engine.close()
    record(f"lean_vs_deepspeeds_layout[{precision}-accum{grad_accum}]", peak_gpu_gib=[runs[False][4], runs[True][4]],
           losses_deepspeeds_layout=runs[False][0], losses_lean=runs[True][0])
    assert runs[True][0] == runs[False][0] and runs[True][3] == runs[False][3]
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_cast_on_the_host_is_the_cast_on_the_gpu_bit_for_bit(monkeypatch, precision):
    """fitone.zero2.upload: the 16-bit cast written by Adam into page-locked host chunks and sent up (2 B a weight)
    against the fp32 master sent up and cast on the GPU (HOST_CAST off), 3 micro-batches a step: every loss, master
    and 16-bit weight the same bits (both round to nearest even), and no fp32 landing chunks on the GPU."""
    from fitone.zero2 import upload

    runs = {}
    for on_host in (False, True):
        monkeypatch.setattr(upload, "HOST_CAST", on_host)
        engine = gpu_engine(precision, pipelined=True, grad_accum=3)
        try:
            uploads = engine.overlap.uploads
            assert uploads.on_host == on_host
            assert all(c.is_cuda != on_host and (not on_host or c.is_pinned()) for c in uploads._chunks)
            losses = [train_step(engine, step, 3) for step in range(1, STEPS + 1)]
            engine.sync_weights()
            runs[on_host] = losses, weights(engine), masters(engine), engine.skipped_steps
        finally:
            engine.close()
    record(f"host_cast_vs_gpu_cast[{precision}]", losses_gpu_cast=runs[False][0], losses_host_cast=runs[True][0])
    assert runs[True][0] == runs[False][0] and runs[True][3] == runs[False][3]
    assert runs[False][0][-1] < 0.8 * runs[False][0][0]  # the updates moved the loss
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))
