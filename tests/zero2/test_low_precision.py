"""The 16-bit optimizer states' AdamW step (fitone.zero2.low_precision) against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from fitone.zero2.low_precision import NEAREST, STOCHASTIC, RandomBits, Workspace, adamw_16bit

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _states(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g).bfloat16()
    exp_avg = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    exp_avg_sq = (torch.rand(n, generator=g) * 1e-4).bfloat16()
    grad = torch.randn(n, generator=g) * 1e-2
    return master, exp_avg, exp_avg_sq, grad


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at each float64 value (8 significant bits)."""
    return torch.pow(2.0, torch.floor(torch.log2(x.abs().clamp_min(1e-38))) - 7)


def _bound(exact: torch.Tensor, operands: torch.Tensor) -> torch.Tensor:
    """How far a bf16 result may lie from the float64 one: one bf16 spacing, plus a few fp32 roundings of
    the operands (where m's two terms cancel, those exceed the result's own spacing)."""
    return _spacing(exact) + 2.0**-21 * operands


def _operands(master, exp_avg, exp_avg_sq, grad) -> tuple[torch.Tensor, ...]:
    g = grad.double().abs()
    return master.double().abs(), exp_avg.double().abs() + g, exp_avg_sq.double() + g * g


def reference(master, exp_avg, exp_avg_sq, grad, *, step, lr, betas, eps, weight_decay, grad_scale=None):
    """The same AdamW step in float64, not rounded: (p, m, v)."""
    b1, b2 = betas
    g = grad.double() / (grad_scale or 1.0)
    p = master.double() * (1 - lr * weight_decay)
    m = exp_avg.double() * b1 + g * (1 - b1)
    v = exp_avg_sq.double() * b2 + g * g * (1 - b2)
    denom = v.sqrt() / math.sqrt(1 - b2 ** step) + eps
    return p - lr / (1 - b1 ** step) * m / denom, m, v


@pytest.mark.parametrize("grad_scale", [None, 3.0])
def test_round_to_nearest_is_the_float64_step_rounded_to_bf16(grad_scale):
    master, exp_avg, exp_avg_sq, grad = _states(50_000)
    want = reference(master, exp_avg, exp_avg_sq, grad, step=7, grad_scale=grad_scale, **HYPER)
    operands = _operands(master, exp_avg, exp_avg_sq, grad)
    before = grad.clone()
    adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=7, grad_scale=grad_scale, rounding=NEAREST, **HYPER)
    assert torch.equal(grad, before)  # the gradient is read only
    for got, exact, ops in zip((master, exp_avg, exp_avg_sq), want, operands):
        same = got == exact.bfloat16()
        # fp32 arithmetic moves a value across a bf16 rounding midpoint only where it lies within ~1e-6
        # (relative) of one: there it is the other neighbour, one spacing off, and that is rare
        assert same.float().mean() > 0.999
        assert torch.all((got.double() - exact).abs() <= _bound(exact, ops))


def test_stochastic_rounding_picks_a_neighbour_with_the_probability_of_the_remainder():
    master, exp_avg, exp_avg_sq, grad = _states(50_000, seed=1)
    want = reference(master, exp_avg, exp_avg_sq, grad, step=3, **HYPER)
    operands = _operands(master, exp_avg, exp_avg_sq, grad)
    bits = RandomBits(5)
    drawn = bits.fill(torch.empty(50_000, dtype=torch.int32), bits.offset(3, 0, 0), 0)  # the weights' bits
    u = drawn.double() / 2**16  # as a uniform number in [0, 1)
    adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=3, rounding=STOCHASTIC, bits=bits, **HYPER)
    for got, exact, ops in zip((master, exp_avg, exp_avg_sq), want, operands):  # one of the two neighbours
        assert torch.all((got.double() - exact).abs() <= _bound(exact, ops))
    exact = want[0]
    toward = exact.float().view(torch.int32).bitwise_and(~0xFFFF).view(torch.float32).double()  # truncated
    remainder = (exact - toward).abs() / _spacing(toward)
    up = master.double().abs() > toward.abs()
    # rounded away from zero exactly when u + remainder >= 1, except where fp32 shifted the remainder (~1e-5)
    agree = up == (u + remainder >= 1)
    assert agree.float().mean() > 0.999
    assert abs(up.double().mean() - remainder.mean()) < 0.01  # unbiased: up as often as the remainders say


def test_stochastic_rounding_keeps_updates_far_below_bf16_spacing_that_nearest_loses():
    """lr 1e-4 on weights of 1.0 (bf16 spacing 2**-8 below 1): each step moves a weight by ~lr, a fortieth of
    the spacing. Round-to-nearest never moves; stochastic rounding drifts by 1,000 x lr in expectation."""
    n, steps, lr = 4096, 1000, 1e-4
    finals = {}
    bits, work = RandomBits(0), Workspace(n)
    for rounding in (NEAREST, STOCHASTIC):
        master = torch.ones(n, dtype=torch.bfloat16)
        exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        grad = torch.ones(n)
        for step in range(1, steps + 1):
            adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=step, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.0, rounding=rounding, bits=bits, work=work)
        finals[rounding] = master.double()
    assert torch.all(finals[NEAREST] == 1.0)
    assert abs(finals[STOCHASTIC].mean().item() - (1 - steps * lr)) < 0.005
    assert finals[STOCHASTIC].std().item() > 0  # each element's own bits: not all rounded alike


def _stepped_in_pieces(step, n: int, cuts: list[int], n_threads: int, **kwargs) -> tuple[torch.Tensor, ...]:
    """One stochastic step of `step` (either implementation) over n elements, slice by slice at `cuts`, on
    `n_threads` threads: the master's, m's and v's bf16 patterns."""
    threads = torch.get_num_threads()
    master, exp_avg, exp_avg_sq, grad = _states(n, seed=2)
    bits = RandomBits(9)
    try:
        torch.set_num_threads(n_threads)
        for lo, hi in zip(cuts, cuts[1:]):
            step(master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[lo:hi], step=2, offset=lo,
                 rounding=STOCHASTIC, bits=bits, group=1, **HYPER, **kwargs)
    finally:
        torch.set_num_threads(threads)
    return tuple(t.view(torch.int16) for t in (master, exp_avg, exp_avg_sq))


def test_the_bits_do_not_depend_on_slicing_block_size_or_thread_count():
    runs = [_stepped_in_pieces(adamw_16bit, 40_000, cuts, n_threads, work=Workspace(block))
            for n_threads, block, cuts in ((1, None, [0, 40_000]), (2, 1000, [0, 12_345, 40_000]),
                                           (torch.get_num_threads(), 4096, [0, 30_000, 40_000]))]
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))


def test_each_step_group_and_tensor_draws_other_bits_and_the_table_wraps():
    bits = RandomBits(0)
    a, b, c, d = (bits.fill(torch.empty(10_000, dtype=torch.int32), bits.offset(*key), 0)
                  for key in ((1, 0, 0), (2, 0, 0), (1, 1, 0), (1, 0, 1)))
    for other in (b, c, d):
        assert (a == other).float().mean() < 0.01
    assert abs(a.double().mean() / 2**16 - 0.5) < 0.02 and int(a.min()) >= 0 and int(a.max()) < 2**16
    assert not torch.equal(RandomBits(1).table, bits.table)
    # element index i reads entry (i + offset) mod TABLE_SIZE, across the table's end too
    from fitone.zero2.low_precision import TABLE_SIZE

    across = bits.fill(torch.empty(100, dtype=torch.int32), TABLE_SIZE - 30, 0)
    assert torch.equal(across, torch.cat([bits.table[-30:], bits.table[:70]]))


def test_an_infinite_or_nan_value_stays_so_under_stochastic_rounding():
    master = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    grad = torch.tensor([math.inf, math.nan, 1.0])
    adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=1, rounding=STOCHASTIC, bits=RandomBits(0), **HYPER)
    assert exp_avg[0].isinf() and exp_avg_sq[0].isinf() and master[1].isnan() and master[2].isfinite()


def test_other_dtypes_and_roundings_are_refused():
    master = torch.zeros(4)
    with pytest.raises(ValueError, match="bf16"):
        adamw_16bit(master, master.bfloat16(), master.bfloat16(), master, step=1, **HYPER)
    m16 = master.bfloat16()
    with pytest.raises(ValueError, match="rounding"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, rounding="up", **HYPER)
    with pytest.raises(ValueError, match="RandomBits"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, rounding=STOCHASTIC, **HYPER)


# -- the fused step (fitone/zero2/csrc/adam16.cpp), what the pipelined update runs -------------------------------
def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart two bf16 tensors are, element by element (patterns of one sign are ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.numeric
@pytest.mark.parametrize("rounding", [NEAREST, STOCHASTIC])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("extra", [dict(), dict(grad_scale=3.0), dict(adam_w_mode=False)])
def test_the_fused_step_is_the_reference_step_to_its_rounding(rounding, grad_dtype, extra):
    """Its fp32 operations are the reference's, one IEEE rounding each in the same order, with the same bits.
    PyTorch's kernels behind the reference may round an operation differently (its division by a Python
    scalar does, in rare cases), so a value may be the other bf16 neighbour, and that rarely."""
    from fitone.zero2.low_precision import fused_adamw_16bit

    n = 200_003  # not a multiple of the fused loop's block
    master, exp_avg, exp_avg_sq, grad = _states(n, seed=4)
    grad = grad.to(grad_dtype)
    before = grad.clone()
    hyper = dict(step=6, rounding=rounding, bits=RandomBits(2), group=1, offset=777, **HYPER, **extra)
    want = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    adamw_16bit(*want, grad.float(), **hyper)
    fused_adamw_16bit(master, exp_avg, exp_avg_sq, grad, **hyper)
    assert torch.equal(grad, before)  # read only, in its own dtype
    for got, ref in zip((master, exp_avg, exp_avg_sq), want):
        apart = _bf16_steps_apart(got, ref)
        assert int(apart.max()) <= 1 and (apart == 0).float().mean() > 0.9999


@pytest.mark.numeric
def test_the_fused_steps_bits_do_not_depend_on_slicing_or_thread_count():
    from fitone.zero2.low_precision import fused_adamw_16bit

    runs = [_stepped_in_pieces(fused_adamw_16bit, 300_000, cuts, n_threads)  # cuts inside the op's blocks too
            for n_threads, cuts in ((1, [0, 300_000]), (2, [0, 4095, 123_457, 300_000]), (2, [0, 300_000]))]
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))


def test_the_fused_step_keeps_small_updates_stochastically_and_infinities_as_they_are():
    """The reference's behaviour where it matters most: lr far below bf16's spacing moves weights only under
    stochastic rounding, by the expected amount; an infinite or NaN gradient stays so."""
    from fitone.zero2.low_precision import fused_adamw_16bit

    n, steps, lr = 4096, 500, 1e-4
    bits, finals = RandomBits(0), {}
    for rounding in (NEAREST, STOCHASTIC):
        master = torch.ones(n, dtype=torch.bfloat16)
        exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        grad = torch.ones(n, dtype=torch.bfloat16)
        for step in range(1, steps + 1):
            fused_adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=step, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=0.0, rounding=rounding, bits=bits)
        finals[rounding] = master.double()
    assert torch.all(finals[NEAREST] == 1.0)
    assert abs(finals[STOCHASTIC].mean().item() - (1 - steps * lr)) < 0.005
    master = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    fused_adamw_16bit(master, exp_avg, exp_avg_sq, torch.tensor([math.inf, math.nan, 1.0]), step=1,
                      rounding=STOCHASTIC, bits=bits, **HYPER)
    assert exp_avg[0].isinf() and exp_avg_sq[0].isinf() and master[1].isnan() and master[2].isfinite()


def test_the_fused_step_is_built_once_and_says_so_in_one_line(tmp_path):
    """A fresh extensions folder: the first process builds the op and says so in one line; the next loads the
    cached build and says nothing. (A real build: ~30 s on 2 cores.)"""
    import os
    import subprocess
    import sys

    code = "from fitone.zero2 import low_precision as lp; lp.fused_op(); print('loaded')"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    said = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        said.append([line for line in run.stdout.splitlines() if line.startswith("fitone:")])
        assert run.stdout.splitlines()[-1] == "loaded"
    assert len(said[0]) == 1 and "building fitone's fused 16-bit Adam step once" in said[0][0]
    assert str(tmp_path) in said[0][0] and said[1] == []
