"""The exact fp32 AdamW read straight from 16-bit gradients: PyTorch's fused CPU AdamW, bit for bit, in one pass.

The pipelined update's fp32 Adam (fitone.zero2.overlap) runs `torch._fused_adamw_`, which takes fp32 gradients
only; the lean layout's gradients are 16 bits, so each slice would be widened into an fp32 scratch first, and the
kernel writes the unscaled gradient back into it, which nobody reads. `adamw` (csrc/adam32.cpp) reads the 16-bit
gradient as it is, widens each element in a register and writes only the master and moments: the bytes per
parameter go from ~38 to ~26, and the bits stay those of PyTorch's kernel on the widened gradient.

Those bits depend on PyTorch's dispatch capability (`torch.backends.cpu.get_cpu_capability()`, which
ATEN_CPU_CAPABILITY may lower): its compiler contracted some multiply-adds into FMAs in its AVX2 and AVX512 builds
and none in its DEFAULT one, and not the same ones in its vector loop and its scalar tail. `ARITHMETIC` says, per
capability, which arithmetic each region of a call takes (read off PyTorch's kernel by tests/zero2/test_adam32.py);
under another capability (not x86) the op is not used and the update widens as before.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from fitone import extensions

OP = "fitone_adam32"  # built once per CPU into TORCH_EXTENSIONS_DIR/fitone_adam32_<CPU> (extensions.build_name)
_SOURCE = Path(__file__).parent / "csrc" / "adam32.cpp"
# per capability: (the vector loop's FMAs, fp32 lanes of its vectors, elements of its scalar tail that its compiler
# vectorized with the vector loop's arithmetic)
ARITHMETIC = {"DEFAULT": (False, 8, 0), "AVX2": (True, 8, 0), "AVX512": (True, 16, 8)}
ENABLED = True  # tests set it False to run the widening path it replaces


def _say(text: str) -> None:
    extensions._say(text)


@functools.cache
def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()  # fixed for the process (ATEN_CPU_CAPABILITY is read at start)


@functools.cache
def _built() -> bool:
    if _capability() not in ARITHMETIC:
        _say(f"the exact fp32 AdamW from 16-bit gradients knows no PyTorch capability {_capability()}: "
             "the update widens the gradients instead")
        return False
    try:
        extensions.load_native(OP, _SOURCE)
    except Exception as error:  # no compiler, no headers: today's path still runs
        _say(f"could not build {extensions.OPS[OP]} ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
             "the update widens the gradients instead")
        return False
    return True


def available() -> bool:
    """Whether the op runs here (built on the first call of this machine; a failure is said once, then False)."""
    return ENABLED and _built()


# The gradients the pipelined update hands the op (fp32 ones go to PyTorch's kernel as they are)
READS = (torch.bfloat16, torch.float16)


def reads(dtype: torch.dtype) -> bool:
    """Whether the pipelined update's fp32 Adam reads gradients of `dtype` through the op, rather than widened."""
    return dtype in READS and available()


def adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *, step: int,
          lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: float | None = None,
          adam_w_mode: bool = True, out: torch.Tensor | None = None) -> None:
    """`torch._fused_adamw_` (adam_w_mode) or `torch._fused_adam_` on fp32 `master`, `exp_avg`, `exp_avg_sq`, in
    place, from `grad` (bf16, fp16 or fp32, read only) divided by `grad_scale`, bias-corrected at `step`: the bits
    PyTorch's kernel gives from `grad.float()` in one call on these tensors, under this process's capability. All
    tensors contiguous; the GIL is released meanwhile. `out` (fp16 or bf16, the master's length) gets
    `master.to(out.dtype)`'s bits of the new master, written block by block while it is in cache."""
    _op(master, exp_avg, exp_avg_sq, grad, step, lr, betas, eps, weight_decay, grad_scale, adam_w_mode, 0.0, out)


def redo_adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               grad_scale: float | None, old_grad_scale: float | None, adam_w_mode: bool = True) -> None:
    """Redo, in one pass, a step these states took from `grad` at `old_grad_scale`, now at `grad_scale` (same step
    and hyperparameters): block by block, fitone.zero2.speculative.undo_adamw's inverse (exact to a few fp32
    roundings), then `adamw`'s bits on what it gave back."""
    _op(master, exp_avg, exp_avg_sq, grad, step, lr, betas, eps, weight_decay, grad_scale, adam_w_mode,
        1.0 if old_grad_scale is None else old_grad_scale)


def _op(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, step: int,
        lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: float | None,
        adam_w_mode: bool, undo_scale: float, out: torch.Tensor | None = None) -> None:
    fused, lanes, tail_vector = ARITHMETIC[_capability()]
    beta1, beta2 = betas
    extensions.load_native(OP, _SOURCE).adamw(
        master, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, weight_decay, eps, float(step), adam_w_mode,
        1.0 if grad_scale is None else grad_scale, grad_scale is not None, fused, lanes, tail_vector, undo_scale,
        _NO_OUT if out is None else out)


_NO_OUT = torch.empty(0, dtype=torch.float16)  # the op's "no cast" (an empty tensor: pybind takes no None here)


def torch_adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                grad_scale: float | None = None, adam_w_mode: bool = True) -> None:
    """The same step by PyTorch's kernel, from an fp32 `grad` (which it overwrites with the unscaled gradient
    when `grad_scale` is given)."""
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    beta1, beta2 = betas
    fused([master], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
          beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
          grad_scale=torch.tensor(grad_scale) if grad_scale is not None else None, found_inf=None)


def step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
         out: torch.Tensor | None = None, **hyper: Any) -> None:
    """`adamw` from a 16-bit gradient, `torch_adamw` from an fp32 one: one rule for whoever steps a slice. `out`
    gets the new master's 16-bit cast (after PyTorch's kernel: a second pass there)."""
    if grad.dtype != torch.float32:
        return adamw(master, exp_avg, exp_avg_sq, grad, out=out, **hyper)
    torch_adamw(master, exp_avg, exp_avg_sq, grad, **hyper)
    if out is not None:
        out.copy_(master)
