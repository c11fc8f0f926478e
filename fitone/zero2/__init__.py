"""Everything that reaches into DeepSpeed's ZeRO-2 internals, in one place and pinned to one version.

`fitone.engine` builds DeepSpeed's engine through its public API and hands the optimizer to the pieces
here: the bounded parameter groups and lean host buffers (`layout`), the deferred overflow check
(`overflow`), the clipping norm summed as for one group (`grad_norm`), the overlapped updates (`overlap`),
the reset after an out-of-memory error (`oom`), the step mode (`step_mode`), CPU Adam's C++ step powers on
resume (`cpu_adam`) and the silenced op probe (`ops`).
They use DeepSpeed's private names (`step_mode` alone reads none: it decides which of them a run takes),
so `check_version` refuses any other DeepSpeed with one line.
"""

from __future__ import annotations

from fitone.errors import DeviceError

DEEPSPEED_VERSION = "0.19.8"  # the version every private name used under fitone/zero2 was read from


def check_version() -> None:
    """One line, before any engine exists, where the installed DeepSpeed is not the one fitone was written for."""
    import deepspeed

    found = getattr(deepspeed, "__version__", "unknown")
    if found.split("+")[0] != DEEPSPEED_VERSION:
        raise DeviceError(f"fitone uses DeepSpeed {DEEPSPEED_VERSION}'s ZeRO-2 internals but deepspeed {found} is "
                          f"installed: pip install deepspeed=={DEEPSPEED_VERSION}")


def zero_config_keys() -> list[str]:
    """The keys DeepSpeed's zero_optimization section takes (a --ds-config's others are typos)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return list(DeepSpeedZeroConfig.model_fields)
