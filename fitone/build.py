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


def prepare_for_training(run: Run, model: torch.nn.Module) -> str | None:
    """`model` as training runs it (no KV cache, activation checkpointing, the fused loss); the fused loss's
    backend (None: the model's own loss). The probe's random model is prepared the same way."""
    cfg = run.settings
    model.config.use_cache = False  # training needs no KV cache; with one, packed rows go unseen
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    return fused_loss.prepare(model, device=run.device, precision=run.precision, enabled=cfg.fused_loss)


def build_model(run: Run, make: Callable[[], LoadedModel]) -> tuple[LoadedModel, str | None]:
    """`make()`'s model (loaded weights) prepared as training runs it; also the fused loss's backend."""
    with unforeseen_oom("model build", verbose=run.settings.verbose):
        loaded = make()
        backend = prepare_for_training(run, loaded.model)
    return loaded, backend


def build_engine(run: Run, model: torch.nn.Module, ds_config: dict[str, Any]) -> Engine:
    """The run's ZeRO-2 engine on `model`, with its step mode; the GPU peak is read from its init on."""
    memory.reset_gpu_peak()
    with unforeseen_oom("engine init", verbose=run.settings.verbose):
        return Engine(model, ds_config, **run.mode.engine_options())

