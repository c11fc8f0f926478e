"""The speculative update (--speculative-update, fitone.zero2.speculative) on the GPU: its Adam on chunks whose
gradients the boundary backward has copied to page-locked host memory (each chunk waits for its copies' CUDA
events), the previous update's side-stream uploads finished first, and chunks not started at the step left to
the update beside the next forward. Against the pipelined update without it, over 12 steps of gpt2, both with
fitone's arithmetic from the first step: where every speculation is kept, the same bits
(tests/zero2/test_speculative.py proves the undo on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from conftest import drain, weights
from gpu_lane import gpu_engine, lm_batch, masters, needs_cuda, record

pytestmark = [pytest.mark.gpu, needs_cuda]

STEPS = 12


def run(precision: str, *, speculative: bool, grad_accum: int) -> tuple[list[float], dict, list, dict]:
    engine = gpu_engine(precision, pipelined=True, grad_accum=grad_accum, speculative=speculative)
    engine.optimizer.clip_grad = 1e6  # random-init gpt2's norm is over 1.0: clipping would undo every step
    try:
        # the speculative engine's first step is fitone's arithmetic too (after 0), not DeepSpeed's: the same here
        assert engine.overlap.after == (0 if speculative else 1)
        engine.overlap.after = 0
        losses = []
        for step in range(1, STEPS + 1):  # gpu_lane.train_step's, each step once the speculation has run
            micro_losses = []
            for micro in range(grad_accum):
                loss = engine.forward(lm_batch(step + 1000 * micro))
                engine.backward(loss)
                drain(engine)  # so what is speculated does not depend on the GPU's and CPU's speeds
                engine.step()
                micro_losses.append(loss.detach())
            losses.append(float(torch.stack(micro_losses).float().mean().item()))
        engine.sync_weights()
        totals = dict(engine.overlap.speculation.totals) if speculative else {}
        return losses, weights(engine), masters(engine), totals
    finally:
        engine.close()


@pytest.mark.parametrize(("precision", "grad_accum"), [("bf16", 1), ("bf16", 3), ("fp16", 1)])
def test_the_speculation_kept_on_the_gpu_is_the_pipelined_update_bit_for_bit(precision, grad_accum):
    want_losses, want, want_masters, _ = run(precision, speculative=False, grad_accum=grad_accum)
    got_losses, got, got_masters, totals = run(precision, speculative=True, grad_accum=grad_accum)
    record(f"speculative_vs_pipelined[{precision}-accum{grad_accum}]", totals=totals, losses_pipelined=want_losses,
           losses_speculative=got_losses)
    assert want_losses[-1] < 0.8 * want_losses[0], want_losses  # every update moves the loss
    assert totals["speculated_chunks"] >= STEPS - 1  # it ran on the GPU's copies, every pipelined step
    if totals["rolled_back_chunks"] or totals["redone_chunks"]:  # fp16: an overflow (undone) or a new loss scale
        assert precision == "fp16" and (totals["nonfinite_chunks"] > 0 or totals["redone_chunks"] > 0)
        first = next(k for k, (a, b) in enumerate(zip(got_losses, want_losses)) if a != b)
        assert first > 1 and all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got_losses, want_losses))
        return
    assert got_losses == want_losses
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(got_masters, want_masters))
