"""DeepSpeedCPUAdam's C++ state that no checkpoint holds (DeepSpeed 0.19.8: `ds_opt_adam`, `opt_id`)."""

from __future__ import annotations

from typing import Any

import torch


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
