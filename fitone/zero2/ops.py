"""DeepSpeed's op-compatibility probe, asked once and silenced (0.19.8: `deepspeed.ops.__compatible_ops__`)."""

from __future__ import annotations

from typing import Callable, ContextManager


def probe_ops_quietly(silenced: Callable[[], ContextManager[None]]) -> None:
    """On DeepSpeed's CPU accelerator the process group's setup asks whether each op could be built, once
    per process: that compiles and links small test programs, and the one for async_io prints the
    linker's "cannot find -laio" straight to file descriptor 2, which reads like a failure and is none
    (fitone uses no async I/O). Ask first, with descriptors 1 and 2 pointed at /dev/null; the answer is
    cached, so DeepSpeed does not ask again. On CUDA nothing asks, and nothing is probed here."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if ("__compatible_ops__" in vars(deepspeed.ops)
            or get_accelerator().create_op_builder("ShareMemCommBuilder") is None):
        return
    with silenced():
        deepspeed.ops.__compatible_ops__  # noqa: B018 - computed and cached on first access


def shm_comm_needed() -> bool:
    """Whether DeepSpeed's process group setup will load its shm_comm op (its CPU accelerator, where the op
    can be built); asks the probe above, quietly when quiet_logs ran first."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    return builder is not None and bool(deepspeed.ops.__compatible_ops__.get(builder.NAME, False))
