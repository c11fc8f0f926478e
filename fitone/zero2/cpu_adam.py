"""DeepSpeedCPUAdam's C++ step (DeepSpeed 0.19.8: `ds_opt_adam`, `opt_id`): its state that no checkpoint holds,
and `adam_update`, the same call with the GIL released (csrc/ds_adam.cpp) for the pipelined update's thread."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from fitone import extensions

OP = "fitone_ds_adam"  # built once per CPU into TORCH_EXTENSIONS_DIR (extensions.build_name)
_SOURCE = Path(__file__).parent / "csrc" / "ds_adam.cpp"
ENABLED = True  # tests set it False to hold the GIL-releasing call to DeepSpeed's own


def load_op() -> Any:
    """The binding's module, built on this machine's first call (extensions.load_native)."""
    return extensions.load_native(OP, _SOURCE)


@functools.cache
def _bound(library: str) -> Any:
    """The GIL-releasing binding to DeepSpeed's loaded cpu_adam `library`, or None (said once) where it cannot be."""
    try:
        op = load_op()
        if op.bind(library):
            return op
        reason = f"no {library} loaded, or no ds_adam_step in it"
    except Exception as error:  # no compiler, no headers: DeepSpeed's own call still runs
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    extensions._say(f"could not bind {extensions.OPS[OP]} ({reason}): the first steps' Adam holds the GIL, "
                    "and the next forward waits for it")
    return None


def releasing_op(adam: Any) -> Any:
    """The binding `adam_update` will use for DeepSpeedCPUAdam `adam` (built on this machine's first call), or
    None: DeepSpeed's own call."""
    library = getattr(getattr(adam, "ds_opt_adam", None), "__file__", None)
    return _bound(library) if ENABLED and library else None


def adam_update(adam: Any, step: int, hyper: dict[str, Any], params: torch.Tensor, grads: torch.Tensor,
                exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """DeepSpeedCPUAdam's C++ update of `params` and its moments from fp32 `grads` (one group's `hyper`), in
    DeepSpeed's own library; with the GIL released where the binding is built, so that a thread running it
    leaves the main thread free to launch kernels."""
    beta1, beta2 = hyper["betas"]
    call = releasing_op(adam) or adam.ds_opt_adam
    call.adam_update(adam.opt_id, step, hyper["lr"], beta1, beta2, hyper["eps"], hyper["weight_decay"],
                     hyper["bias_correction"], params, grads, exp_avg, exp_avg_sq)


def replay_steps(adam: Any) -> None:
    """Bring DeepSpeedCPUAdam's C++ bias-correction powers to where the uninterrupted run has them.

    The C++ optimizer keeps beta1**t and beta2**t in float32 and advances them by one multiplication per
    step; a fresh one (after a resume at step N) computes pow(beta, N + 1) instead, which differs in the
    last bits, and the runs drift apart from there. Replaying steps 1..N through `adam_update` on empty
    tensors repeats the same multiplications and touches no weights or moments (no tensor work at all).
    Any other optimizer (PyTorch's Adam, the fused GPU ones) derives the powers from the step count: no-op.
    """
    if adam is None or not hasattr(adam, "ds_opt_adam") or not hasattr(adam, "opt_id"):
        return
    params = [(group, p) for group in adam.param_groups for p in group["params"] if "step" in adam.state.get(p, {})]
    if not params:
        return
    last = max(int(adam.state[p]["step"]) for _, p in params)
    empty = {p: (p.new_empty(0), torch.empty(0, dtype=adam.state[p]["exp_avg"].dtype)) for _, p in params}
    for step in range(1, last + 1):  # in the order DeepSpeedCPUAdam.step calls it: each step, group by group
        for group, p in params:
            if int(adam.state[p]["step"]) >= step:
                weights, moments = empty[p]
                beta1, beta2 = group["betas"]
                adam.ds_opt_adam.adam_update(adam.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                             group["weight_decay"], group["bias_correction"], weights, weights,
                                             moments, moments)


def deepspeeds_chunk(opt: Any, i: int, grad: torch.Tensor, norm: torch.Tensor | None, hyper: dict[str, Any],
                     step: int, lo: int, hi: int) -> None:
    """DeepSpeed's step on elements [lo, hi) of ZeRO-2 optimizer `opt`'s group i: its unscale_and_clip_grads on their
    fp32 gradient (in place), then DeepSpeedCPUAdam's C++ update of them. Both are elementwise, and the C++ optimizer
    moves its bias-correction powers only when the step count does, so chunk after chunk gives the bits of its one
    call per group (chunks on fitone.zero2.overlap.SIMD_BLOCK boundaries: each element takes the same SIMD path)."""
    adam = opt.optimizer
    opt.unscale_and_clip_grads([grad], norm)
    master = opt.single_partition_of_fp32_groups[i]
    state = adam.state[master]
    adam_update(adam, step, hyper, master.data[lo:hi], grad, state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi])
