"""A run's decisions, made once: `resolve(cfg) -> Run`, handed down to training, the probe and the plan.

The device, ranks, concrete precision, model config and task, the user's --ds-config (read and validated
once), the DeepSpeed sections that do not depend on the batch, the optimizer step and the GPU cap in bytes
are decided here and nowhere else. The micro-batch and accumulation (`with_batch`) and the run's length
(`with_steps`) are added to a new Run once known. Nothing here starts a process group or allocates:
`fitone plan` resolves too (`resolve_planned`, for the card it plans for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from fitone import ds_config, runtime
from fitone.config import TrainConfig, resolve_precision
from fitone.errors import ConfigError, ModelError
from fitone.models import (SEQ2SEQ, config_and_notes, from_scratch_hint, require_model, shipped_models, shipped_twin,
                           task_of)
from fitone.runtime import DistInfo, Placement, Runtime
from fitone.units import parse_size
from fitone.zero2 import step_mode
from fitone.zero2.step_mode import StepMode


WEIGHT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Run(Placement):
    """What a run decided. `settings` are the user's, as given: read its precision, step and cap from here."""

    settings: TrainConfig
    device: str  # 'cuda' or 'cpu'
    dist: DistInfo
    precision: str  # 'fp16', 'bf16' or 'fp32': never 'auto'
    model_config: Any  # transformers' PretrainedConfig, no weights
    task: str  # models.SEQ2SEQ or models.CAUSAL
    user_ds: dict[str, Any] | None  # --ds-config's contents
    ds_sections: dict[str, Any]  # the DeepSpeed config less its batch sizes and schedule (ds_config.sections)
    mode: StepMode
    cap_bytes: int | None  # --max-gpu-memory
    config_notes: tuple[str, ...] = ()  # what the user is told about the config (a head added, a stand-in)
    micro_batch: int | None = None  # None until an 'auto' size is probed
    accumulation: int | None = None
    total_steps: int | None = None

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine keeps the model's weights in on the device."""
        return WEIGHT_DTYPES[self.precision]

    def from_scratch_placement(self) -> dict[str, Any]:
        """Where and in what a from-scratch model is built (load_model's device and dtype): on a GPU in the
        engine's dtype, in seconds (the CPU's init takes minutes a billion parameters, and a 7B in fp32 fits no
        24 GB card); on the CPU as the architecture builds it."""
        on_gpu = self.device == "cuda"
        return dict(device=self.device if on_gpu else None, dtype=self.weights_dtype if on_gpu else None)

    @property
    def batch_is_auto(self) -> bool:
        """--batch-size auto: the micro-batch is probed (the one place the string is compared)."""
        return self.settings.batch_size == "auto"

    def with_batch(self, micro_batch: int) -> Run:
        """This run at `micro_batch` per rank, its accumulation derived (a --global-batch it does not divide
        is refused)."""
        return replace(self, micro_batch=micro_batch,
                       accumulation=self.settings.accumulation(micro_batch, self.world_size))

    def with_given_batch(self) -> Run:
        """At the user's --batch-size N (its accumulation checked before anything heavy); an 'auto' run as is."""
        return self if self.batch_is_auto else self.with_batch(int(self.settings.batch_size))

    def with_steps(self, total_steps: int) -> Run:
        return replace(self, total_steps=total_steps)

    def for_probe(self) -> Run:
        """As a probe runs it: one GPU, micro-batch 1, every step an optimizer step, no known length (DeepSpeed
        fixes the micro-batch at init but takes any batch shape in forward)."""
        return replace(self, dist=DistInfo(self.dist.rank, self.dist.local_rank, 1, 1), mode=self.mode.on_one_gpu(),
                       micro_batch=1, accumulation=1, total_steps=None)

    def runtime(self) -> Runtime:
        """The process's runtime for this run, not started (Runtime.start does the heavy part)."""
        cfg = self.settings
        return Runtime(device=self.device, dist=self.dist, verbose=cfg.verbose,
                       expandable_segments=cfg.expandable_segments, cap_bytes=self.cap_bytes,
                       max_gpu_memory=cfg.max_gpu_memory)


def resolve(cfg: TrainConfig) -> Run:
    """The decisions of a run on this machine: its device (checked against it) and its rank in the launcher's
    (or a single process's) distributed env."""
    require_model(cfg.model)
    device = runtime.resolve_device(cfg)
    run = _decide(cfg, device, runtime.ensure_dist_env())
    if cfg.precision == "auto" and device == "cpu" and run.is_main:
        print("fitone: no GPU: training in fp32 on the CPU (fp16 needs a CUDA GPU; --precision bf16 is "
              "faster on CPUs with bf16 instructions)", flush=True)
    if cfg.gpu_adam_share and not run.mode.gpu_share and run.is_main:  # e.g. a recipe's share, off its one GPU
        where = ("on the CPU" if device == "cpu" else f"on {run.dist.world_size} ranks" if run.dist.world_size > 1
                 else "under DeepSpeed's step")
        print(f"fitone: gpu_adam_share {cfg.gpu_adam_share} steps part of one GPU's pipelined update: {where} the "
              "CPU steps every chunk", flush=True)
    return run


def resolve_planned(cfg: TrainConfig, gpus: int, nodes: int = 1) -> Run:
    """The decisions of a run on the card `fitone plan` plans for (a GPU unless --device cpu), on `gpus` ranks on
    each of `nodes` machines: nothing is read from this machine's GPU or distributed env."""
    require_model(cfg.model)
    return _decide(cfg, "cpu" if cfg.device == "cpu" else "cuda", DistInfo(0, 0, gpus * nodes, gpus), planning=True)


def start_runtime(cfg: TrainConfig) -> Run:
    """resolve, and start its runtime: for callers (tests, benchmarks) that build an engine directly (at
    `run.with_batch(N)`)."""
    run = resolve(cfg)
    run.runtime().start()
    return run


def _decide(cfg: TrainConfig, device: str, dist: DistInfo, *, planning: bool = False) -> Run:
    on_gpu = device == "cuda"
    precision = resolve_precision(cfg.precision, on_gpu=on_gpu)
    # once per run: a config, no weights
    config, notes = (_planned_config if planning else config_and_notes)(cfg.model, from_scratch=cfg.from_scratch)
    user = ds_config.read_user_config(cfg.ds_config) if cfg.ds_config else None
    sections = ds_config.sections(cfg, precision=precision, on_gpu=on_gpu, user=user)
    # which optimizer step: decided once (a flag it cannot honour refused) before any weights load
    mode = step_mode.decide(sections, delayed_update=cfg.delayed_update,
                            delayed_update_after=cfg.delayed_update_after, pipelined_update=cfg.pipelined_update,
                            world_size=dist.world_size, on_gpu=on_gpu, optimizer_states=cfg.optimizer_states,
                            seed=cfg.seed, speculative_update=cfg.speculative_update,
                            gpu_adam_share=cfg.gpu_adam_share)
    task = task_of(config)
    if task == SEQ2SEQ and "seq_len" in cfg.typed:  # it would be ignored without a word
        raise ConfigError(f"--seq-len is for causal LMs; {cfg.model} is seq2seq: give --src-len and --tgt-len "
                          f"(now {cfg.src_len} and {cfg.tgt_len}) instead")
    return Run(settings=cfg, device=device, dist=dist, precision=precision, model_config=config, task=task,
               user_ds=user, ds_sections=sections, mode=mode,
               cap_bytes=parse_size(cfg.max_gpu_memory, "--max-gpu-memory"), config_notes=tuple(notes))


def _planned_config(name: str, *, from_scratch: bool) -> tuple[Any, list[str]]:
    """The config a plan reads, and its notes. Planning needs the architecture, not the weights: a shipped name,
    or the shipped twin of a hub id that is not on this machine, stands in for weights it does not have."""
    if not from_scratch and name in shipped_models() and not os.path.exists(name):
        config, notes = config_and_notes(name, from_scratch=True)
        return config, [*notes, f"{name}: planned from fitone's shipped config (no weights needed)"]
    try:
        return config_and_notes(name, from_scratch=from_scratch)
    except ModelError:
        twin = None if from_scratch or os.path.exists(name) else shipped_twin(name)
        if twin is None:
            raise
        config, notes = config_and_notes(twin, from_scratch=True)
        return config, [*notes, f"{name} is not on this machine: planned from fitone's shipped {twin} config, its "
                                f"architecture; training needs its weights, or random ones: {from_scratch_hint(twin)}"]
