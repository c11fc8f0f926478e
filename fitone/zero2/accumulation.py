"""Accumulated steps on an engine built for none: the probe times (micro-batch, accumulation) pairs on its
one engine, which DeepSpeed built with accumulation 1 (an engine init per pair would cost more than the probe).

Inside `accumulating(ds, optimizer, n)` the engine and its ZeRO-2 optimizer count `n` micro-steps to an
optimizer step, as an engine built for `n` does; the caller marks each micro-step's boundary before its
forward (DeepSpeed's public `set_gradient_accumulation_boundary`), so the engine's earlier micro-steps do
not shift where the boundary falls. On exit both are back at 1, and DeepSpeed counts the boundary itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def accumulating(ds: Any, optimizer: Any, steps: int) -> Iterator[Callable[[int], None]]:
    """Yields `before_micro_step(i)`, to call before micro-step i (0-based) of each optimizer step."""
    micro, world = ds.train_micro_batch_size_per_gpu(), ds.dp_world_size
    built = optimizer.gradient_accumulation_steps
    ds.set_train_batch_size(micro * steps * world)  # the loss's 1/n scaling, as training's engine
    optimizer.gradient_accumulation_steps = steps  # private: which buffer the offloaded norm reads

    def before_micro_step(i: int) -> None:
        ds.set_gradient_accumulation_boundary(i == steps - 1)

    try:
        yield before_micro_step
    finally:
        ds.set_train_batch_size(micro * built * world)
        optimizer.gradient_accumulation_steps = built
        # None: DeepSpeed counts micro-steps again (each backward hands the optimizer the engine's boundary)
        ds.set_gradient_accumulation_boundary(None)
