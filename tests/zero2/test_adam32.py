"""The exact fp32 AdamW from 16-bit gradients (fitone.zero2.adam32, csrc/adam32.cpp) against PyTorch's fused CPU
AdamW on the widened gradient: bit for bit, under this process's CPU capability and, in children, under DEFAULT
and AVX2 (ATEN_CPU_CAPABILITY)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fitone.zero2 import adam32

# sizes: under one vector, around the vector and cache-line units, tails of every length, and a multi-block one
SIZES = [1, 7, 8, 9, 15, 16, 17, 23, 31, 64 * 5 + 13, 4096 * 3 + 8 + 5, 200_003]
# (lr, betas, eps, weight_decay, step, grad_scale, adam_w_mode)
CASES = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1),
    dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0, step=7, grad_scale=1024.0),
    dict(lr=1e-2, betas=(0.3, 0.999), eps=1e-8, weight_decay=0.1, step=123, grad_scale=3.0),  # the lerp's other form
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=2, adam_w_mode=False),  # Adam's decay
    dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0, step=40, grad_scale=65536.0, adam_w_mode=False),
]


def _states(n: int, seed: int, grad_dtype: torch.dtype, scale: float | None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g) * 1e-2
    exp_avg_sq = torch.rand(n, generator=g) * 1e-4
    grad = (torch.randn(n, generator=g) * 1e-2 * (scale or 1.0)).to(grad_dtype)
    return master, exp_avg, exp_avg_sq, grad


def _mismatches(n: int, seed: int, grad_dtype: torch.dtype, case: dict) -> list[int]:
    """Elements of master, exp_avg, exp_avg_sq where the op and PyTorch's kernel on grad.float() differ."""
    master, exp_avg, exp_avg_sq, grad = _states(n, seed, grad_dtype, case.get("grad_scale"))
    want = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    adam32.torch_adamw(*want, grad.float().clone(), **case)  # (it writes the unscaled gradient)
    before = grad.clone()
    adam32.adamw(master, exp_avg, exp_avg_sq, grad, **case)
    assert torch.equal(grad, before)  # read only: no unscaled gradient written back
    return [int((got != ref).sum()) for got, ref in zip((master, exp_avg, exp_avg_sq), want)]


@pytest.mark.numeric
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_op_is_pytorchs_fused_adam_bit_for_bit(grad_dtype, case):
    """Every element of every size (every tail length, the vector loop's and the scalar tail's arithmetic)."""
    bad = {n: _mismatches(n, seed=n + case, grad_dtype=grad_dtype, case=CASES[case]) for n in SIZES}
    assert all(counts == [0, 0, 0] for counts in bad.values()), (torch.backends.cpu.get_cpu_capability(), bad)


@pytest.mark.numeric
def test_the_op_is_bit_for_bit_on_a_nonzero_start_and_a_second_step():
    """States carried over a step (moments not random), and a tensor that is a slice of a larger one."""
    case = CASES[0]
    base = [t.clone() for t in _states(10_000 + 21, 5, torch.bfloat16, None)]
    ours = [t[3:].clone() for t in base[:3]]
    theirs = [t.clone() for t in ours]
    for step in (1, 2):
        grad = base[3][3:]
        adam32.adamw(*ours, grad, **{**case, "step": step})
        adam32.torch_adamw(*theirs, grad.float().clone(), **{**case, "step": step})
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.numeric
@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_the_op_is_bit_for_bit_under_a_lower_cpu_capability(capability):
    """PyTorch's kernel rounds differently under each SIMD level (FMAs or none); the op follows the one its
    process runs (a child, as ATEN_CPU_CAPABILITY is read at start)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "numeric",
                            f"{__file__}::test_the_op_is_pytorchs_fused_adam_bit_for_bit"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]


@pytest.mark.numeric
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_ops_16_bit_cast_of_the_new_master_is_master_to_dtype_bit_for_bit(grad_dtype, out_dtype):
    """`out` gets master.to(dtype) of the new master, every size's blocks and tails, fp16's overflow to inf, its
    subnormals and a tie of each kind among them; the step itself is unchanged. `step` casts after PyTorch's kernel
    for an fp32 gradient: the same bits."""
    case = {**CASES[1], "lr": 1e-20}  # a step too small to move the ties and subnormals below off their values
    for n in SIZES:
        master, exp_avg, exp_avg_sq, grad = _states(n, n, grad_dtype, case["grad_scale"])
        master[: n // 2] *= 10.0 ** torch.linspace(-9, 6, n // 2)  # fp16's subnormals, its range and beyond
        ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 2**-24 * 1.5, 1 + 2**-8, 1 + 3 * 2**-8, 65520.0, 65519.0])
        master[-min(n, 7):] = ties[:min(n, 7)]
        plain = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        adam32.adamw(*plain, grad, **case)
        out = torch.full((n,), -1.0, dtype=out_dtype)
        states = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        adam32.step(*states, grad if grad_dtype != torch.float32 else grad.clone(), out=out, **case)
        if grad_dtype != torch.float32:  # the op's arithmetic; fp32 gradients take PyTorch's kernel, tested above
            assert all(torch.equal(a, b) for a, b in zip(states, plain)), n
        assert torch.equal(out.view(torch.int16), states[0].to(out_dtype).view(torch.int16)), (n, out_dtype)
        if n == SIZES[-1] and out_dtype == torch.float16:  # the cases named above were there
            assert out.isinf().any() and ((out != 0) & (out.abs() < 2**-14)).any()
            assert torch.equal(states[0][-7:], ties) and not torch.equal(out[-7:].float(), ties)


def test_the_op_refuses_a_cast_it_cannot_write():
    master, exp_avg, exp_avg_sq, grad = _states(64, 0, torch.bfloat16, None)
    for bad in (torch.empty(63, dtype=torch.float16), torch.empty(64), torch.empty(128, dtype=torch.bfloat16)[::2]):
        with pytest.raises(RuntimeError, match="16-bit cast"):
            adam32.adamw(master, exp_avg, exp_avg_sq, grad, **CASES[0], out=bad)


def test_the_capabilities_differ_so_the_choice_matters():
    """DEFAULT's arithmetic (no FMA) is not AVX2's: were they alike, the capability table would be moot."""
    master, exp_avg, exp_avg_sq, grad = _states(4096, 1, torch.bfloat16, None)
    runs = []
    for row in ("DEFAULT", "AVX2"):
        states = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        fused, lanes, tail = adam32.ARITHMETIC[row]
        adam32.extensions.load_native(adam32.OP, adam32._SOURCE).adamw(
            *states, grad, 1e-3, 0.9, 0.999, 0.01, 1e-8, 3.0, True, 1.0, False, fused, lanes, tail, 0.0, adam32._NO_OUT)
        runs.append(states)
    assert not torch.equal(runs[0][1], runs[1][1])


def test_a_failed_build_falls_back_and_says_so_once(monkeypatch, capsys):
    said = []
    monkeypatch.setattr(adam32, "_say", said.append)

    def no_compiler(*_args):
        raise RuntimeError("Error building extension 'fitone_adam32'\nc++: not found")

    monkeypatch.setattr(adam32.extensions, "load_native", no_compiler)
    adam32._built.cache_clear()
    try:
        assert not adam32.available() and not adam32.available()
    finally:
        adam32._built.cache_clear()
    assert len(said) == 1 and "could not build" in said[0] and "widens the gradients instead" in said[0]
    monkeypatch.setattr(adam32, "ENABLED", False)
    assert not adam32.available()


# -- in the pipelined update (fitone.zero2.overlap): the same training as the widening path it replaces ----------
@pytest.mark.numeric
@pytest.mark.parametrize("precision, grad_accum, clip", [("bf16", 1, 1e6), ("bf16", 3, 1.0), ("fp32", 1, 1.0),
                                                         ("fp32", 3, 1e6)])
def test_the_pipelined_update_reading_16_bits_trains_as_the_widening_one_bit_for_bit(monkeypatch, precision,
                                                                                     grad_accum, clip):
    """Per micro-batch losses and the final fp32 master and moments, op on and forced off; clip 1.0 clips (a scale
    that is not 1), 1e6 does not. fp32 training has fp32 gradients: nothing to read in 16 bits, nothing changes."""
    from test_speculative import identical, make_engine, train

    calls, op = [], adam32.adamw
    monkeypatch.setattr(adam32, "adamw", lambda *args, **kwargs: calls.append(op(*args, **kwargs)))
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(adam32, "ENABLED", enabled)
        engine = make_engine(precision, speculative=False, grad_accum=grad_accum, clip=clip)
        try:
            assert engine.overlap.reads_16bit == (enabled and precision == "bf16")
            chunks = sum(map(len, engine.overlap.chunks))
            runs.append(train(engine, 5, grad_accum))
        finally:
            engine.close()
        if enabled:  # one call a chunk of each pipelined step (steps 2-5), in bf16 only
            assert len(calls) == (4 * chunks if precision == "bf16" else 0)
    assert identical(*runs)


@pytest.mark.numeric
@pytest.mark.parametrize("speculative", [False, True])
def test_the_cast_written_by_the_op_trains_as_the_cast_after_it_bit_for_bit(monkeypatch, speculative):
    """fitone.zero2.upload.HOST_CAST (opt-in): the op writes each chunk's 16-bit cast as it steps it (on the CPU
    straight into the weights), against the cast copied after it; with the speculation, the chunks it kept or redid
    are cast after. Clip 1.0 clips, 3 micro-batches a step: the same bits."""
    from test_speculative import identical, make_engine, train

    from fitone.zero2 import upload

    casts, op = [], adam32.adamw
    monkeypatch.setattr(adam32, "adamw", lambda *args, **kwargs: (casts.append(kwargs.get("out") is not None),
                                                                  op(*args, **kwargs))[1])
    runs = []
    for on_host in (True, False):
        monkeypatch.setattr(upload, "HOST_CAST", on_host)
        engine = make_engine("bf16", speculative=speculative, grad_accum=3, clip=1.0)
        try:
            assert engine.overlap.uploads.on_host == on_host
            runs.append(train(engine, 5, 3))
        finally:
            engine.close()
        assert any(casts) == on_host  # the op wrote casts only where asked
        casts.clear()
    assert identical(*runs)


@pytest.mark.numeric
def test_the_speculative_update_reading_16_bits_trains_as_the_widening_pipelined_one(monkeypatch):
    """The speculation runs the update's own kernel, so it reads 16 bits too, and is kept: still bit for bit."""
    from test_speculative import identical, make_engine, train

    runs = []
    for enabled, speculative in ((True, True), (False, False)):
        monkeypatch.setattr(adam32, "ENABLED", enabled)
        engine = make_engine("bf16", speculative=speculative)
        try:
            runs.append(train(engine, 5))
            if speculative:
                totals = engine.overlap.speculation.totals
                assert totals["speculated_chunks"] > 0 and totals["rolled_back_chunks"] == 0
        finally:
            engine.close()
    assert identical(*runs)


def test_the_update_hands_the_op_16_bit_gradients_only():
    # fp32 gradients need no widening: PyTorch's kernel reads them as they are
    assert not adam32.reads(torch.float32)
    assert adam32.reads(torch.bfloat16) == adam32.reads(torch.float16) == adam32.available()
