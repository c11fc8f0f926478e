"""AdamW on 16-bit optimizer states: bf16 master weights and bf16 moments, computed in fp32, rounded back.

What `--optimizer-states bf16` runs in the pipelined update instead of fused fp32 AdamW. Each element's
master weight and moments are widened to fp32 (exact), stepped with AdamW's arithmetic in fp32, and rounded
back to bf16 either to the nearest (an update smaller than half a weight's bf16 spacing, 0.2-0.4% of the
weight, is lost) or stochastically: rounded up with the probability of the remainder, so small updates are
kept in expectation. Or compensated (Kahan summation, `--optimizer-states bf16-kahan`): a bf16 compensation
buffer holds what rounding the weight to the nearest lost, and the next step adds it back before stepping,
so small updates accumulate there until they move the weight (2 B/param more).

Stochastic rounding's 16 random bits per element are entry (index + offset) of a table of TABLE_SIZE hashed
values, the offset hashed from (seed, step, group, which tensor): no random state needs checkpointing, a
resume is bit-exact, and how a group is cut into chunks does not change them. A block of consecutive elements
reads a contiguous run of the table (a copy, not a gather). Elements TABLE_SIZE apart share their bits within
a step; each one's bits still change from step to step, which is what keeps its rounding unbiased.

Two implementations of one arithmetic:
- `fused_adamw_16bit`, what the pipelined update runs: one pass per element in C++ (csrc/adam16.cpp, built
  once per machine by `fused_op`), from the 16-bit gradient as it is, reading the bits from the table's int16
  copy (`RandomBits.extended`). Compiled without FMA contraction: its bits depend neither on the thread count
  nor on the CPU's SIMD level. Why it replaced the other: bench/results/2026-12-02-cpu-fused16/.
- `adamw_16bit`, the reference the tests hold it to: each operation one elementwise torch kernel with one IEEE
  rounding, into preallocated blocks (no addcdiv, lerp or alpha= forms, which a compiler may fuse into an FMA
  on one instruction set and not on another).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from fitone import extensions

NEAREST, STOCHASTIC = "nearest", "stochastic"
ROUNDINGS = (NEAREST, STOCHASTIC)
ROUNDING_OF_STATES = {"bf16": STOCHASTIC, "bf16-nearest": NEAREST, "bf16-kahan": NEAREST}  # --optimizer-states
COMPENSATED = ("bf16-kahan",)  # the states that keep a bf16 compensation buffer beside the master (Kahan)
# elements the reference steps per block: its five fp32, two int32 and one bool buffers stay in cache
BLOCK_ELEMENTS = 2**18
TABLE_SIZE = 2**20 + 7  # stochastic rounding's table of random bits (int32): not a power of two, 4 MiB
FUSED_BLOCK = 4096  # the fused step's inner loop (csrc/adam16.cpp BLOCK): its table repeats this many entries
_MASK32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
_EXPONENT = 0x7F800000  # an fp32 pattern whose magnitude reaches this is infinite or NaN


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' hash-prospector two-round mix) of int64 values in [0, 2**32), in place.
    Both multipliers are below 2**31, so every product stays below 2**63: no signed overflow."""
    x.bitwise_xor_(x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    return x


def _hash_of(*parts: int) -> int:
    key = torch.tensor([0], dtype=torch.int64)
    for part in parts:
        key = hash32(key.bitwise_xor_(part & _MASK32))
    return int(key)


class RandomBits:
    """Stochastic rounding's bits for one seed: `TABLE_SIZE` 16-bit values (int32), hashed from the seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self._table: torch.Tensor | None = None
        self._extended: torch.Tensor | None = None

    @property
    def table(self) -> torch.Tensor:
        """The bits as int32 (what `fill` copies from; made on first use)."""
        if self._table is None:
            table = torch.arange(TABLE_SIZE, dtype=torch.int64).bitwise_xor_(_hash_of(self.seed))
            self._table = hash32(hash32(table)).bitwise_and_(_LOW16).to(torch.int32)
        return self._table

    @property
    def extended(self) -> torch.Tensor:
        """The fused step's copy (2 B an entry): the table in int16, then its first FUSED_BLOCK entries again, so
        that a block of the fused loop reads one contiguous run across the table's end."""
        if self._extended is None:
            table = self._table if self._table is not None else RandomBits(self.seed).table
            self._extended = torch.cat([table, table[:FUSED_BLOCK]]).to(torch.int16)  # wraps into int16 exactly
        return self._extended

    def offset(self, step: int, group: int, tensor: int) -> int:
        """Where element 0 of `group`'s `tensor` (0 master, 1 and 2 the moments) reads the table at `step`."""
        return _hash_of(self.seed, step, group, tensor) % TABLE_SIZE

    def fill(self, out: torch.Tensor, offset: int, lo: int) -> torch.Tensor:
        """The bits of elements [lo, lo + len(out)) at `offset`, into `out` (at most TABLE_SIZE of them)."""
        n = out.numel()
        start = (lo + offset) % TABLE_SIZE
        first = min(n, TABLE_SIZE - start)
        out[:first].copy_(self.table[start:start + first])
        if first < n:
            out[first:].copy_(self.table[:n - first])
        return out


class Workspace:
    """The preallocated blocks one `adamw_16bit` call steps through (a fresh tensor per operation would cost
    more in page faults than the arithmetic). One per thread."""

    def __init__(self, block: int | None = None):
        self.block = block or BLOCK_ELEMENTS

        def buffer(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(self.block, dtype=dtype)

        self.g, self.p, self.m, self.v, self.t = (buffer(torch.float32) for _ in range(5))
        self.bits, self.wide = buffer(torch.int32), buffer(torch.int32)
        self.nonfinite = buffer(torch.bool)


def host_bytes(rounding: str) -> int:
    """What the pipelined update's fused step holds beside the states: stochastic rounding's 16-bit table
    (`RandomBits.extended`); nothing to the nearest. (The reference `adamw_16bit` holds a Workspace too.)"""
    return 2 * (TABLE_SIZE + FUSED_BLOCK) if rounding == STOCHASTIC else 0


def round_to_bf16(x: torch.Tensor, out: torch.Tensor, bits: torch.Tensor | None, work: Workspace) -> None:
    """fp32 `x` into bf16 `out`: to the nearest (bits None), else stochastically by `bits` (int32 in
    [0, 2**16), clobbered): adding them to the fp32 pattern's low half and truncating rounds the magnitude up
    with probability remainder / spacing (sign-magnitude, so alike for negative numbers). An infinity or NaN
    takes no bits (its pattern plus bits could read as another number). `x` is clobbered."""
    if bits is not None:
        n = x.numel()
        pattern = x.view(torch.int32)
        magnitude = torch.bitwise_and(pattern, 0x7FFFFFFF, out=work.wide[:n])
        if int(magnitude.max()) >= _EXPONENT:  # rare: the mask only then
            bits.masked_fill_(torch.ge(magnitude, _EXPONENT, out=work.nonfinite[:n]), 0)
        pattern.add_(bits).bitwise_and_(~_LOW16)  # now a bf16 number: the copy below is exact
    out.copy_(x)


def _check(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, rounding: str,
           bits: RandomBits | None, compensation: torch.Tensor | None) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
    if rounding == STOCHASTIC and bits is None:
        raise ValueError("stochastic rounding needs its RandomBits")
    if compensation is not None and (rounding != NEAREST or compensation.numel() != master.numel()):
        raise ValueError("the compensation holds the error of rounding to the nearest, one per master weight")
    for t in (master, exp_avg, exp_avg_sq) + (() if compensation is None else (compensation,)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"the 16-bit step holds bf16 master weights and moments, not {t.dtype}")


def adamw_16bit(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                grad_scale: float | None = None, adam_w_mode: bool = True, bias_correction: bool = True,
                rounding: str = NEAREST, bits: RandomBits | None = None, group: int = 0, offset: int = 0,
                compensation: torch.Tensor | None = None, work: Workspace | None = None) -> None:
    """One Adam(W) step, in place, on bf16 `master`, `exp_avg`, `exp_avg_sq` (one slice of a group's flat
    buffers starting at element `offset` of group `group`) from fp32 `grad` (read only), divided by
    `grad_scale` first. AdamW's arithmetic as PyTorch's AdamW writes it, each operation rounded to fp32:
        g = grad / grad_scale;  (Adam, not W: g = g + wd * p)
        p = p * (1 - lr * wd);  m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
        p = p - (m / (sqrt(v) / sqrt(bc2) + eps)) * (lr / bc1)   with bc = 1 - b ** step
    then p, m and v rounded to bf16: to the nearest, or (STOCHASTIC) by `bits`' table (a RandomBits; keyed by
    step, group and element index: the result does not depend on how a group is cut into slices).
    `compensation` (bf16, to the nearest only; Kahan summation): the weight is p + c, and after the step
        master = bf16(p);  compensation = bf16(p - master)   (0 where that is infinite or NaN)
    so what the rounding lost is added back next step. `work`: the blocks to step through (one is made for
    this call without it)."""
    _check(master, exp_avg, exp_avg_sq, rounding, bits, compensation)
    beta1, beta2 = betas
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1 - beta2 ** step) if bias_correction else 1.0
    step_size = lr / bc1
    offsets = [bits.offset(step, group, k) for k in range(3)] if rounding == STOCHASTIC else None
    n = master.numel()
    work = work or Workspace(min(BLOCK_ELEMENTS, max(n, 1)))
    for lo in range(0, n, work.block):
        hi = min(lo + work.block, n)
        k = hi - lo
        g, p, m, v, t = work.g[:k], work.p[:k], work.m[:k], work.v[:k], work.t[:k]
        g.copy_(grad[lo:hi])
        if grad_scale is not None:
            g.div_(grad_scale)
        p.copy_(master[lo:hi])
        if compensation is not None:
            p.add_(t.copy_(compensation[lo:hi]))
        if weight_decay != 0:
            if adam_w_mode:
                p.mul_(1 - lr * weight_decay)
            else:
                g.add_(torch.mul(p, weight_decay, out=t))
        m.copy_(exp_avg[lo:hi]).mul_(beta1).add_(torch.mul(g, 1 - beta1, out=t))
        v.copy_(exp_avg_sq[lo:hi]).mul_(beta2).add_(g.mul_(g).mul_(1 - beta2))
        torch.sqrt(v, out=t).div_(bc2_sqrt).add_(eps)
        p.sub_(g.copy_(m).div_(t).mul_(step_size))
        if compensation is not None:  # the weight to the nearest, then what that lost (exact in fp32)
            master[lo:hi].copy_(p)
            p.sub_(t.copy_(master[lo:hi])).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            compensation[lo:hi].copy_(p)
        for value, out, which in ((p, master, 0), (m, exp_avg, 1), (v, exp_avg_sq, 2)):
            if which == 0 and compensation is not None:
                continue
            drawn = None if offsets is None else bits.fill(work.bits[:k], offsets[which], offset + lo)
            round_to_bf16(value, out[lo:hi], drawn, work)


# -- the fused step -------------------------------------------------------------------------------------------
FUSED_OP = "fitone_adam16"  # built once per CPU into TORCH_EXTENSIONS_DIR/fitone_adam16_<CPU> (extensions.build_name)
_SOURCE = Path(__file__).parent / "csrc" / "adam16.cpp"
_NO_TABLE = torch.empty(0, dtype=torch.int16)
_NO_COMPENSATION = torch.empty(0, dtype=torch.bfloat16)


def fused_op() -> Any:
    """The fused step's C++ module, built on the first call of this machine (one line says so) and cached."""
    return extensions.load_native(FUSED_OP, _SOURCE)


def fused_adamw_16bit(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                      *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                      grad_scale: float | None = None, adam_w_mode: bool = True, bias_correction: bool = True,
                      rounding: str = NEAREST, bits: RandomBits | None = None, group: int = 0,
                      offset: int = 0, compensation: torch.Tensor | None = None) -> None:
    """`adamw_16bit`'s step in one pass (fitone/zero2/csrc/adam16.cpp), from a bf16, fp16 or fp32 `grad`
    read as it is: the same fp32 operations in the same order and the same random bits, without the blocks
    (the GIL released meanwhile). All tensors contiguous."""
    _check(master, exp_avg, exp_avg_sq, rounding, bits, compensation)
    beta1, beta2 = betas
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1 - beta2 ** step) if bias_correction else 1.0
    tables = [bits.offset(step, group, k) for k in range(3)] if rounding == STOCHASTIC else [0, 0, 0]
    fused_op().adamw_16bit(master, exp_avg, exp_avg_sq, _NO_COMPENSATION if compensation is None else compensation,
                           grad, offset, grad_scale or 1.0, grad_scale is not None,
                           1 - lr * weight_decay, weight_decay, adam_w_mode, weight_decay != 0, beta1, 1 - beta1,
                           beta2, 1 - beta2, bc2_sqrt, eps, lr / bc1, rounding == STOCHASTIC,
                           bits.extended if rounding == STOCHASTIC else _NO_TABLE, *tables)


def chunk_step(opt: Any, i: int, grad: torch.Tensor, scale: float | None, hyper: dict[str, Any], step: int, lo: int,
               hi: int, *, rounding: str, bits: RandomBits | None, compensated: bool) -> None:
    """AdamW on elements [lo, hi) of ZeRO-2 optimizer `opt`'s group i, its bf16 master and moments, from their
    16-bit gradient in one fused pass (`fused_adamw_16bit`; the pipelined update's 16-bit states)."""
    adam = opt.optimizer
    master = opt.single_partition_of_fp32_groups[i]
    state = adam.state[master]
    compensation = state["compensation"][lo:hi] if compensated else None
    fused_adamw_16bit(master.data[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi], grad, step=step,
                      lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                      grad_scale=scale, adam_w_mode=getattr(adam, "adam_w_mode", True),
                      bias_correction=hyper["bias_correction"], rounding=rounding, bits=bits, group=i, offset=lo,
                      compensation=compensation)
