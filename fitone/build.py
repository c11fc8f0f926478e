"""A run's model and DeepSpeed engine, built one way for training and for the probe's trials, so that a
probe's trial holds what training will hold: the model as training runs it (no KV cache, activation
checkpointing, the fused loss) and the engine of the run's step mode."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fitone import loss as fused_loss
from fitone import memory
from fitone.engine import Engine
from fitone.models import LoadedModel, enable_activation_checkpointing
from fitone.plan import unforeseen_oom
from fitone.run import Run


def build_model(run: Run, make: Callable[[], LoadedModel]) -> tuple[LoadedModel, str | None]:
    """`make()`'s model (loaded weights, or the probe's random ones) prepared as training runs it; also the
    fused loss's backend (None: the model's own loss)."""
    cfg = run.settings
    with unforeseen_oom("model build", verbose=cfg.verbose):
        loaded = make()
        loaded.model.config.use_cache = False  # training needs no KV cache; with one, packed rows go unseen
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(loaded.model)
        backend = fused_loss.prepare(loaded.model, device=run.device, precision=run.precision,
                                     enabled=cfg.fused_loss)
    return loaded, backend


def build_engine(run: Run, model: torch.nn.Module, ds_config: dict[str, Any]) -> Engine:
    """The run's ZeRO-2 engine on `model`, with its step mode; the GPU peak is read from its init on."""
    memory.reset_gpu_peak()
    with unforeseen_oom("engine init", verbose=run.settings.verbose):
        return Engine(model, ds_config, **run.mode.engine_options())


def build_model_and_engine(run: Run, make: Callable[[], LoadedModel], ds_config: dict[str, Any], *,
                           on_model: Callable[[torch.nn.Module], None] | None = None,
                           ) -> tuple[LoadedModel, Engine, str | None]:
    """build_model, then (after `on_model(model)`, where given) build_engine: the model, the engine and the
    fused loss's backend."""
    loaded, backend = build_model(run, make)
    if on_model is not None:
        on_model(loaded.model)
    return loaded, build_engine(run, loaded.model, ds_config), backend
