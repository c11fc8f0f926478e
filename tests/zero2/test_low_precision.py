"""The 16-bit optimizer states' AdamW step (fitone.zero2.low_precision) against a float64 reference: rounded
to the nearest, stochastically, or to the nearest with a compensation buffer (Kahan summation)."""

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


def _compensation(master: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A compensation such as steps leave: below half the master's bf16 spacing, either sign."""
    g = torch.Generator().manual_seed(seed)
    return (master.double() * (torch.rand(master.numel(), generator=g, dtype=torch.float64) - 0.5) / 256).bfloat16()


@pytest.mark.parametrize("grad_scale", [None, 3.0])
def test_with_compensation_master_plus_compensation_is_the_float64_step_of_their_sum(grad_scale):
    """Kahan summation: the step starts from p + c and ends with p the nearest bf16 and c what that lost, so
    p + c carries ~16 significant bits of the weight where p alone has 8."""
    master, exp_avg, exp_avg_sq, grad = _states(50_000, seed=3)
    compensation = _compensation(master)
    start = (master.float() + compensation.float()).double()  # what the step widens: one fp32 addition
    want = reference(start, exp_avg, exp_avg_sq, grad, step=5, grad_scale=grad_scale, **HYPER)
    operands = _operands(start, exp_avg, exp_avg_sq, grad)
    adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=5, grad_scale=grad_scale, compensation=compensation,
                **HYPER)
    exact = want[0]
    assert torch.all((master.double() - exact).abs() <= _bound(exact, operands[0]))  # p: its nearest bf16
    assert (master == exact.bfloat16()).float().mean() > 0.999
    carried = master.double() + compensation.double()
    # p + c: within one bf16 spacing of c (c is under half p's spacing: 2**-8 of it) plus fp32's roundings
    assert torch.all((carried - exact).abs() <= _spacing(exact) / 2**8 + 2.0**-21 * operands[0])
    assert (carried - exact).abs().mean() < (master.double() - exact).abs().mean() / 50  # far closer than p
    for got, ref, ops in zip((exp_avg, exp_avg_sq), want[1:], operands[1:]):  # the moments: to the nearest
        assert torch.all((got.double() - ref).abs() <= _bound(ref, ops))


def _compensated_small_steps(step, steps: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` compensated steps of `step` on weights of 1.0 with betas 0: each update is lr exactly (m = g = 1,
    v = 1, no bias correction to speak of), so only the weight's rounding is under test. (master, compensation)"""
    n = 4096
    master = torch.ones(n, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq, compensation = (torch.zeros_like(master) for _ in range(3))
    grad = torch.ones(n, dtype=torch.bfloat16)
    for k in range(1, steps + 1):
        step(master, exp_avg, exp_avg_sq, grad, step=k, lr=lr, betas=(0.0, 0.0), eps=1e-8, weight_decay=0.0,
             compensation=compensation)
    return master.double(), compensation.double()


def test_compensation_keeps_updates_far_below_bf16_spacing_that_nearest_loses():
    """The small-updates case above: each step's lr, a fortieth of the weight's spacing, accumulates in the
    compensation until it moves the weight, deterministically (no bits). What is lost is the compensation's
    own rounding, at most 2**-18 a step below 1 (half its spacing, |c| < 2**-9): against nearest's 0.1."""
    steps, lr = 1000, 1e-4
    master, compensation = _compensated_small_steps(adamw_16bit, steps, lr)
    assert torch.all((master + compensation - (1 - steps * lr)).abs() <= steps * 2.0**-18)
    assert torch.all((master - (1 - steps * lr)).abs() <= 2.0**-8)  # the weight itself moved, to ~0.9


def _stepped_in_pieces(step, n: int, cuts: list[int], n_threads: int, compensated: bool = False,
                       **kwargs) -> tuple[torch.Tensor, ...]:
    """One stochastic step of `step` (either implementation) over n elements, slice by slice at `cuts`, on
    `n_threads` threads: the master's, m's and v's bf16 patterns (`compensated`: a step to the nearest with a
    compensation, whose patterns come last)."""
    threads = torch.get_num_threads()
    master, exp_avg, exp_avg_sq, grad = _states(n, seed=2)
    compensation = _compensation(master, seed=2) if compensated else None
    bits = RandomBits(9)
    try:
        torch.set_num_threads(n_threads)
        for lo, hi in zip(cuts, cuts[1:]):
            rounding = dict(compensation=compensation[lo:hi]) if compensated else dict(rounding=STOCHASTIC)
            step(master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[lo:hi], step=2, offset=lo, bits=bits,
                 group=1, **rounding, **HYPER, **kwargs)
    finally:
        torch.set_num_threads(threads)
    held = (master, exp_avg, exp_avg_sq) + ((compensation,) if compensated else ())
    return tuple(t.view(torch.int16) for t in held)


@pytest.mark.parametrize("compensated", [False, True])
def test_the_bits_do_not_depend_on_slicing_block_size_or_thread_count(compensated):
    runs = [_stepped_in_pieces(adamw_16bit, 40_000, cuts, n_threads, compensated, work=Workspace(block))
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


def _nonfinite_compensated(step) -> tuple[torch.Tensor, ...]:
    """One compensated step of `step` from an infinite, a NaN and a finite gradient."""
    master = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    exp_avg, exp_avg_sq, compensation = (torch.zeros_like(master) for _ in range(3))
    step(master, exp_avg, exp_avg_sq, torch.tensor([math.inf, math.nan, 1.0]), step=1, compensation=compensation,
         **HYPER)
    return master, exp_avg, exp_avg_sq, compensation


def test_a_nan_weight_stays_nan_and_its_compensation_zero():
    """The compensation is 0 where the weight is not finite (it would be NaN: inf - inf): the weight alone says
    what happened, as without compensation."""
    master, exp_avg, exp_avg_sq, compensation = _nonfinite_compensated(adamw_16bit)
    assert exp_avg[0].isinf() and master[0].isnan() and master[1].isnan() and master[2].isfinite()
    assert compensation[0] == 0 and compensation[1] == 0 and compensation[2].isfinite()


def test_other_dtypes_and_roundings_are_refused():
    master = torch.zeros(4)
    with pytest.raises(ValueError, match="bf16"):
        adamw_16bit(master, master.bfloat16(), master.bfloat16(), master, step=1, **HYPER)
    m16 = master.bfloat16()
    with pytest.raises(ValueError, match="rounding"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, rounding="up", **HYPER)
    with pytest.raises(ValueError, match="RandomBits"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, rounding=STOCHASTIC, **HYPER)
    with pytest.raises(ValueError, match="compensation holds the error of rounding to the nearest"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, rounding=STOCHASTIC, bits=RandomBits(0),
                    compensation=m16.clone(), **HYPER)
    with pytest.raises(ValueError, match="one per master weight"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, compensation=m16[:2].clone(), **HYPER)
    with pytest.raises(ValueError, match="bf16"):
        adamw_16bit(m16, m16.clone(), m16.clone(), master, step=1, compensation=master.clone(), **HYPER)


# -- the fused step (fitone/zero2/csrc/adam16.cpp), what the pipelined update runs -------------------------------
def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart two bf16 tensors are, element by element (patterns of one sign are ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


KAHAN = "nearest, compensated"  # a test parameter: rounding to the nearest with a compensation buffer


@pytest.mark.numeric
@pytest.mark.parametrize("rounding", [NEAREST, STOCHASTIC, KAHAN])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("extra", [dict(), dict(grad_scale=3.0), dict(adam_w_mode=False)])
def test_the_fused_step_is_the_reference_step_to_its_rounding(rounding, grad_dtype, extra):
    """Its fp32 operations are the reference's, one IEEE rounding each in the same order, with the same bits.
    PyTorch's kernels behind the reference may round an operation differently (its division by a Python
    scalar does, in rare cases), so a value may be the other bf16 neighbour, and that rarely. Where the
    master is, its compensation (what the rounding lost) is another number: there p + c agrees instead."""
    from fitone.zero2.low_precision import fused_adamw_16bit

    n = 200_003  # not a multiple of the fused loop's block
    master, exp_avg, exp_avg_sq, grad = _states(n, seed=4)
    grad = grad.to(grad_dtype)
    before = grad.clone()
    compensation = _compensation(master, seed=4) if rounding == KAHAN else None
    operand = master.double().abs()
    hyper = dict(step=6, rounding=NEAREST if rounding == KAHAN else rounding, bits=RandomBits(2), group=1,
                 offset=777, **HYPER, **extra)
    held = (master, exp_avg, exp_avg_sq) + ((compensation,) if rounding == KAHAN else ())
    want = [t.clone() for t in held]
    adamw_16bit(*want[:3], grad.float(), compensation=want[3] if rounding == KAHAN else None, **hyper)
    fused_adamw_16bit(master, exp_avg, exp_avg_sq, grad, compensation=compensation, **hyper)
    assert torch.equal(grad, before)  # read only, in its own dtype
    for got, ref in zip((master, exp_avg, exp_avg_sq), want):
        apart = _bf16_steps_apart(got, ref)
        assert int(apart.max()) <= 1 and (apart == 0).float().mean() > 0.9999
    if rounding == KAHAN:
        assert (compensation == want[3]).float().mean() > 0.9999
        carried, ref_carried = (p.double() + c.double() for p, c in ((master, compensation), want[::3]))
        # where fp32's p was an ulp or so off (of the operands: the weight before), c is one of its own bf16
        # spacings off: p + c holds ~16 bits of the weight
        assert torch.all((carried - ref_carried).abs() <= _spacing(want[3].double()) + 2.0**-21 * operand)


@pytest.mark.numeric
@pytest.mark.parametrize("compensated", [False, True])
def test_the_fused_steps_bits_do_not_depend_on_slicing_or_thread_count(compensated):
    from fitone.zero2.low_precision import fused_adamw_16bit

    runs = [_stepped_in_pieces(fused_adamw_16bit, 300_000, cuts, n_threads, compensated)  # cuts inside blocks too
            for n_threads, cuts in ((1, [0, 300_000]), (2, [0, 4095, 123_457, 300_000]), (2, [0, 300_000]))]
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))


# sizes: under one vector, around 8 and 16 lanes, one block (FUSED_BLOCK) and a lane or an element either side of
# one, and several blocks with a tail
ODD_SIZES = [1, 7, 8, 9, 15, 17, 4095, 4096, 4097, 3 * 4096 + 13, 100_003]


def _gradient_in_each_dtype(n: int, seed: int) -> dict[torch.dtype, torch.Tensor]:
    """One gradient as fp16, bf16 and fp32, of values all three hold exactly (bf16's 8 significant bits within
    fp16's normal range, zeros of either sign)."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(n, generator=g) * 1e-2).bfloat16().float()
    wide = torch.where(wide.abs() < 2.0**-14, torch.copysign(torch.zeros(n), wide), wide)
    wide[:2] = torch.tensor([-0.0, 2.0**-14])[:n]  # -0 and fp16's smallest normal
    assert torch.equal(wide.half().float(), wide) and torch.equal(wide.bfloat16().float(), wide)
    return {dtype: wide.to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}


def _fused_patterns(n: int, grad: torch.Tensor, rounding: str, extra: dict) -> list[torch.Tensor]:
    """One fused step from `grad` on the states of seed n: the bf16 patterns it leaves (compensation last)."""
    from fitone.zero2.low_precision import fused_adamw_16bit

    master, exp_avg, exp_avg_sq, _ = _states(n, seed=n)
    compensation = _compensation(master, seed=n) if rounding == KAHAN else None
    hyper = {**HYPER, **extra}
    fused_adamw_16bit(master, exp_avg, exp_avg_sq, grad, step=4, rounding=NEAREST if rounding == KAHAN else rounding,
                      bits=RandomBits(3), group=2, offset=n * 31, compensation=compensation, **hyper)
    return [t.view(torch.int16) for t in (master, exp_avg, exp_avg_sq, compensation) if t is not None]


@pytest.mark.numeric
@pytest.mark.parametrize("rounding", [NEAREST, STOCHASTIC, KAHAN])
@pytest.mark.parametrize("extra", [dict(), dict(grad_scale=3.0), dict(weight_decay=0.0),
                                   dict(adam_w_mode=False, grad_scale=1024.0)])
def test_the_fused_step_from_fp16_is_its_step_from_bf16_and_fp32_bit_for_bit(rounding, extra):
    """The fp16 gradient is widened a block at a time (F16C where the CPU has it, element by element where not)
    before the loop the fp32 gradient runs: the same values, so the same bits at every size and tail, and as from
    bf16 where bf16 holds the same values. Every fp16 pattern (subnormals, infinities, NaNs) against fp32 too."""
    for n in ODD_SIZES:
        grads = _gradient_in_each_dtype(n, seed=n + 1)
        want = _fused_patterns(n, grads[torch.float32], rounding, extra)
        for dtype in (torch.float16, torch.bfloat16):
            got = _fused_patterns(n, grads[dtype], rounding, extra)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, dtype)
    every = torch.arange(-2**15, 2**15 + 3, dtype=torch.int32).to(torch.int16).view(torch.float16)  # a tail of 3
    every = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))]
    got, want = (_fused_patterns(every.numel(), grad, rounding, extra) for grad in (every, every.float()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


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


def test_the_fused_step_compensates_small_updates_and_zeroes_a_nonfinite_compensation():
    """Kahan summation in the fused step where it matters most: lr far below bf16's spacing moves the weights
    to where fp32 would have them, as the reference does; a NaN weight gets a compensation of 0."""
    from fitone.zero2.low_precision import fused_adamw_16bit

    steps, lr = 500, 1e-4
    master, compensation = _compensated_small_steps(fused_adamw_16bit, steps, lr)
    assert torch.all((master + compensation - (1 - steps * lr)).abs() <= steps * 2.0**-18)
    assert torch.all((master - (1 - steps * lr)).abs() <= 2.0**-8)
    fused, ref = _nonfinite_compensated(fused_adamw_16bit), _nonfinite_compensated(adamw_16bit)
    assert all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(fused, ref))


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
