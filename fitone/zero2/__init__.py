"""Everything that reaches into DeepSpeed's ZeRO-2 internals, in one place and pinned to one version.

`fitone.engine` builds DeepSpeed's engine through its public API and hands the optimizer to the pieces
here: the bounded parameter groups and lean host buffers (`layout`), the deferred overflow check
(`overflow`), the clipping norm summed as for one group (`grad_norm`), the overlapped updates (`overlap`, `delayed`)
the pipelined one's opt-in speculative Adam (`speculative`) and its share of Adam on the GPU (`gpu_adam`),
the reset after an out-of-memory error (`oom`), the step mode (`step_mode`), CPU Adam's C++ step powers on
resume (`cpu_adam`) and the silenced op probe (`ops`).
They use DeepSpeed's private names (`step_mode` alone reads none: it decides which of them a run takes),
so `check_version` refuses any other DeepSpeed with one line. DeepSpeed's error texts (`errors`) and the few
facts the rest of fitone asks of DeepSpeed (below) live here too: outside fitone/zero2 only fitone.engine and
fitone.runtime import DeepSpeed (tests/test_layering.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from fitone.errors import DeviceError

DEEPSPEED_VERSION = "0.19.8"  # the version every private name used under fitone/zero2 was read from


def check_version() -> None:
    """One line, before any engine exists, where the installed DeepSpeed is not the one fitone was written for."""
    found = installed_version()
    if found.split("+")[0] != DEEPSPEED_VERSION:
        raise DeviceError(f"fitone uses DeepSpeed {DEEPSPEED_VERSION}'s ZeRO-2 internals but deepspeed {found} is "
                          f"installed: pip install deepspeed=={DEEPSPEED_VERSION}")


def installed_version() -> str:
    """The installed DeepSpeed's version string, as probe results and their cache keys record it."""
    import deepspeed

    return getattr(deepspeed, "__version__", "unknown")


def zero_config_keys() -> list[str]:
    """The keys DeepSpeed's `zero_optimization` section accepts (its pydantic model's fields)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return list(DeepSpeedZeroConfig.model_fields)


def model_states_estimate(n_params: int, *, gpus: int, nodes: int = 1, offload: bool,
                          on_gpu: bool) -> dict[str, int] | None:
    """DeepSpeed's own bytes for ZeRO-2's model states (estimate_zero2_model_states_mem_needs), to set beside
    fitone's plan; None where DeepSpeed cannot be imported (an optional comparison, never why a plan fails)."""
    if not on_gpu:  # DeepSpeed falls back to its CPU accelerator itself, warning that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        # DeepSpeed's logger writes to stdout from import on; keep `fitone plan --json` one JSON object
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:
        return None
    host, gpu = estimate_zero2_model_states_mem_needs(n_params, num_gpus_per_node=gpus, num_nodes=nodes,
                                                      cpu_offload=offload)
    return {"gpu": int(gpu), "host": int(host)}


def wrapped_optimizer(zero_optimizer: Any) -> Any:
    """The torch optimizer ZeRO-2 steps (DeepSpeedCPUAdam under offload), or None (DeepSpeed 0.19.8 keeps it
    as the ZeRO optimizer's `optimizer`)."""
    return getattr(zero_optimizer, "optimizer", None)
