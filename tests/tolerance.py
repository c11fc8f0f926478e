"""How far two correct computations may drift apart, from the arithmetic alone.

Each bound is built from the dtype's machine epsilon (the spacing of its numbers in [1, 2)), the number
of steps over which differences can build up, and the size of the values compared. None depends on the
CPU: its SIMD width or bf16 kernels decide which of the allowed roundings happen, not how many there are.
A test that needs "equal" (the same operations on the same numbers) asserts equality instead.
"""

from __future__ import annotations

import math

import torch

EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}  # 2^-23, 2^-7

# Weight matrices the tiny T5 (tests' t5-tiny: 2 + 2 blocks) applies one after another between the input
# ids and the loss: per encoder block attention scores, values, output and feed-forward in, out (5); per
# decoder block self- and cross-attention (3 each) and feed-forward (2); then the tied LM head. A relative
# error of r in every weight moves the loss by at most about DEPTH x r, to first order. (gpt2-tiny, the
# other test model, applies 2 x 6 + 1 = 13: the bound holds for it too.)
T5_TINY_DEPTH = 2 * 5 + 2 * 8 + 1

# Steps over which the drift bounds below hold for two whole training runs. Training amplifies a gap
# step by step (the next gradients see the gap, and a fast-learning run turns them into the next one), so
# past some steps it grows geometrically, which no rounding bound covers. On the tests' sample task the
# fp32 gap stays linear through step 8 (tests/zero2/test_overlap.py); whole-run comparisons between two
# different implementations of the same arithmetic are made over these first steps.
LINEAR_STEPS = 8


def ulp(x: float, precision: str) -> float:
    """One rounding step of the dtype at |x| (the spacing of its numbers there)."""
    return 2.0 ** math.floor(math.log2(abs(x))) * EPS[precision] if x else EPS[precision]


def adam_weight_drift(w: torch.Tensor, steps: int, lr: float) -> float:
    """Largest gap between fp32 weights updated by PyTorch's fused AdamW and by DeepSpeedCPUAdam from the
    same start over `steps` steps, for one tensor whose largest magnitude is max|w|.

    Per step each implementation writes its new weight rounded to nearest (half an ulp each: at most
    eps x max|w| apart), and forms the step lr x m/(sqrt(v) + eps_adam) along another order of operations
    (a few roundings of a number below lr: 4 x eps x lr). The gap carries into the next gradients: taken at
    weights a few ulps apart they differ most where they nearly cancel, and Adam's normalisation turns such
    an element's relative difference into its step's. That part has no rounding bound; it is allowed 3 more
    ulps of the weight per step, which holds with room on the tests' tiny T5 over 8 steps.
    """
    return steps * EPS["fp32"] * (4 * float(w.abs().max()) + 4 * lr)


def fp32_loss_drift(loss: float, steps: int, depth: int = T5_TINY_DEPTH) -> float:
    """Largest gap between fp32 losses of two runs whose weights drift apart as `adam_weight_drift` says:
    at most 4 x steps x eps relative in every weight, carried through `depth` weight matrices (first
    order), plus each loss's own rounding (half an ulp each)."""
    return (4 * depth * steps + 1) * EPS["fp32"] * abs(loss)


def bf16_loss_drift(loss: float, steps: int) -> float:
    """Largest gap between bf16 losses of two runs whose fp32 master weights drift apart as above.

    The bf16 weights are those masters rounded: equal except where a master lies within the drift of a
    rounding midpoint, there one bf16 ulp apart. A handful of such weights moves the loss by far less than
    the loss's own rounding step, so a step can flip that rounding at most: one ulp of the loss per step
    since the runs' arithmetic first differed. (A stale weight, one update old, moves it by many.)
    """
    return max(steps, 1) * ulp(loss, "bf16")


def bf16_weight_drift(w: torch.Tensor, steps: int) -> float:
    """Largest gap between bf16 weights of two such runs: a rounding step of the tensor's largest
    magnitude per step since the runs first differed (each step can move a master across at most one
    more bf16 midpoint than the other run's)."""
    return max(steps, 1) * ulp(float(w.float().abs().max()), "bf16")


def apart(got: list[float], want: list[float], bound, *, first_differing_step: int) -> list[tuple[int, float, float]]:
    """The steps (1-based) where two loss curves are further apart than bound(want, k) allows, k being the
    number of steps whose arithmetic could differ so far (0 before `first_differing_step`)."""
    assert len(got) == len(want), (len(got), len(want))
    return [(step, g, w) for step, (g, w) in enumerate(zip(got, want), 1)
            if abs(g - w) > bound(w, max(0, step - first_differing_step + 1))]


# Matrix products between a causal LM block's input and its output, one after another: the q/k/v
# projections (side by side), attention scores, the scores' weighted values, the output projection, the
# feed-forward's in and out. A logit is this many per block deep, plus the LM head.
PRODUCTS_PER_BLOCK = 6


def fp32_logit_drift(logits: torch.Tensor, blocks: int, terms: int) -> float:
    """Largest gap between two fp32 forwards of the same weights on the same tokens that differ only in the
    order of their sums (one example alone, or inside a longer packed row: other shapes take other matrix
    kernels and attention splits), for logits whose largest magnitude is max|logits|.

    A sum of n products taken in two orders differs by at most n x eps of the sum of their magnitudes (each
    order is within n x eps/2 of the exact sum: Higham's gamma_n). A logit is PRODUCTS_PER_BLOCK x blocks + 1
    such sums deep, none longer than `terms` (masked keys add exact zeros); each block's norm rescales its
    input, so the sums' magnitudes stay at the logits' scale and, to first order, their errors add."""
    return (PRODUCTS_PER_BLOCK * blocks + 1) * terms * EPS["fp32"] * float(logits.abs().max())
