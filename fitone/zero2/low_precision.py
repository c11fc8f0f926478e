"""AdamW on 16-bit optimizer states: bf16 master weights and bf16 moments, computed in fp32, rounded back.

What `--optimizer-states bf16` runs in the pipelined update instead of fused fp32 AdamW. Each element's
master weight and moments are widened to fp32 (exact), stepped with AdamW's arithmetic in fp32, and rounded
back to bf16 either to the nearest (an update smaller than half a weight's bf16 spacing, about 2**-9 of the
weight, is lost) or stochastically: rounded up with the probability of the remainder, so small updates are
kept in expectation. The random bits come from a hash of (seed, step, group, element index), so no random
state needs checkpointing, a resume is bit-exact, and chunking does not change them.

Every operation is one elementwise torch kernel with one IEEE rounding (no addcdiv, lerp or alpha= forms,
which a compiler may fuse into an FMA on one instruction set and not on another): the bits depend neither
on the thread count nor on the CPU's SIMD width.
"""

from __future__ import annotations

import math

import torch

NEAREST, STOCHASTIC = "nearest", "stochastic"
ROUNDINGS = (NEAREST, STOCHASTIC)
ROUNDING_OF_STATES = {"bf16": STOCHASTIC, "bf16-nearest": NEAREST}  # --optimizer-states (fitone.config)
# elements stepped per fp32 working block: five fp32 blocks stay in cache, and per-block overhead is small
BLOCK_ELEMENTS = 2**20
_MASK32 = 0xFFFFFFFF
_LOW16 = 0xFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' hash-prospector two-round mix) of int64 values in [0, 2**32), in place.
    Both multipliers are below 2**31, so every product stays below 2**63: no signed overflow."""
    x.bitwise_xor_(x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    return x


def salt(seed: int, step: int, group: int) -> int:
    """The 32-bit key of one step of one parameter group: every element's random bits are hashed from it."""
    key = torch.tensor([seed & _MASK32], dtype=torch.int64)
    for part in (step, group):
        key = hash32(key.bitwise_xor_(part & _MASK32))
    return int(key)


def random_bits(key: int, lo: int, hi: int) -> torch.Tensor:
    """32 random bits (int64) for each element index in [lo, hi) under `key`; a function of the index only."""
    x = torch.arange(lo, hi, dtype=torch.int64)
    x.bitwise_and_(_MASK32).bitwise_xor_(key)
    return hash32(hash32(x))


def round_to_bf16(x: torch.Tensor, out: torch.Tensor, bits: torch.Tensor | None) -> None:
    """fp32 `x` into bf16 `out`: to the nearest (bits None), else stochastically by 16 random `bits` (int32 in
    [0, 2**16)): adding them to the fp32 pattern's low half and truncating rounds the magnitude up with
    probability remainder / spacing (sign-magnitude, so the same for negative numbers). `x` is clobbered."""
    if bits is None:
        out.copy_(x)
        return
    bits.masked_fill_(x.isinf(), 0)  # an infinity stays one (its pattern plus bits would read as NaN)
    x.view(torch.int32).add_(bits).bitwise_and_(~_LOW16)  # now a bf16 number: the copy below is exact
    out.copy_(x)


def adamw_16bit(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                grad_scale: float | None = None, adam_w_mode: bool = True, bias_correction: bool = True,
                rounding: str = NEAREST, seed: int = 0, group: int = 0, offset: int = 0,
                block: int | None = None) -> None:
    """One Adam(W) step, in place, on bf16 `master`, `exp_avg`, `exp_avg_sq` (one slice of a group's flat
    buffers starting at element `offset` of group `group`) from fp32 `grad`, divided by `grad_scale` first.
    AdamW's arithmetic as PyTorch's AdamW writes it, each operation rounded to fp32:
        g = grad / grad_scale;  (Adam, not W: g = g + wd * p)
        p = p * (1 - lr * wd);  m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
        p = p - (lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))   with bc = 1 - b ** step
    then p, m and v rounded to bf16 (`rounding`: NEAREST or STOCHASTIC, whose bits are keyed by seed, step,
    group and element index: the result does not depend on how a group is cut into slices)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
    for t in (master, exp_avg, exp_avg_sq):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"the 16-bit step holds bf16 master weights and moments, not {t.dtype}")
    beta1, beta2 = betas
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1 - beta2 ** step) if bias_correction else 1.0
    step_size = lr / bc1
    key = salt(seed, step, group) if rounding == STOCHASTIC else None
    block = block or BLOCK_ELEMENTS
    n = master.numel()
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        g = grad[lo:hi].to(torch.float32, copy=True)  # the caller's gradient is read, not overwritten
        if grad_scale is not None:
            g = g.div_(grad_scale)
        p = master[lo:hi].float()
        if weight_decay != 0:
            if adam_w_mode:
                p.mul_(1 - lr * weight_decay)
            else:
                g.add_(p * weight_decay)
        m = exp_avg[lo:hi].float().mul_(beta1).add_(g * (1 - beta1))
        v = exp_avg_sq[lo:hi].float().mul_(beta2).add_(g.mul_(g).mul_(1 - beta2))
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
        p.sub_(m.div(denom).mul_(step_size))
        bits = None if key is None else random_bits(key, offset + lo, offset + hi)
        for value, out, shift in ((p, master, 0), (m, exp_avg, 16), (v, exp_avg_sq, None)):
            if bits is None:
                round_to_bf16(value, out[lo:hi], None)
                continue
            if shift is None:  # the third tensor's 16 bits come from a second hash
                b16 = hash32(bits).bitwise_and_(_LOW16)
            else:
                b16 = (bits >> shift).bitwise_and_(_LOW16)
            round_to_bf16(value, out[lo:hi], b16.to(torch.int32))
