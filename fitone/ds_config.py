"""A run's decisions -> DeepSpeed config dict. Pure functions, tested by value for each option; they decide
nothing (the precision and device are fitone.run's, which optimizer step runs is fitone.zero2.step_mode's).

The defaults follow the source blog's one-GPU recipe for t5-3b (ZeRO-2, optimizer on CPU, 2e8
buckets, contiguous gradients, overlap_comm on a GPU); `--ds-config FILE` is merged on top, with
unknown keys rejected because DeepSpeed itself silently ignores typos at the top level.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitone.config import TrainConfig, check_keys
from fitone.errors import ConfigError
from fitone.zero2 import zero_config_keys

if TYPE_CHECKING:
    from fitone.run import Run

BUCKET_SIZE = int(2e8)  # elements; overlap_comm holds ~4.5x this in extra buffers (DeepSpeed docs)

# Top-level sections DeepSpeed reads; anything else in a user's file is a typo.
KNOWN_TOP_LEVEL = sorted({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "memory_breakdown", "fp16", "bf16", "amp", "torch_autocast", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "optimizer", "scheduler",
    "activation_checkpointing", "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet",
    "aio", "autotuning", "compression_training", "data_efficiency", "data_types", "checkpoint", "elasticity",
    "nebula", "communication_data_type", "seq_parallel_communication_data_type", "timers", "compile",
    "disable_allgather", "eigenvalue", "pipeline", "sparse_attention", "curriculum_learning",
    "use_data_before_expert_parallelism", "dataloader_drop_last", "progressive_layer_drop", "graph_harvesting",
    "weight_quantization", "hybrid_engine", "mics_shard_size", "mics_hierarchical_params_gather",
    "load_universal_checkpoint", "use_node_local_storage", "fp32_allreduce",
})


def loss_scale_section() -> dict[str, Any]:
    """fp16 with dynamic loss scaling: start at 2^16, halve on overflow, double after 1000 clean steps."""
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}


def sections(cfg: TrainConfig, *, precision: str, on_gpu: bool, user: dict[str, Any] | None) -> dict[str, Any]:
    """The DeepSpeed config less what depends on the batch and the run's length, the user's --ds-config
    (`user`, read by read_user_config) merged over it: composed once per run (fitone.run), read by the step
    mode and the plan, and completed per engine by build_ds_config."""
    ds: dict[str, Any] = {
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 10**9,  # fitone logs itself; DeepSpeed's own lines only with --verbose
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": BUCKET_SIZE,
            "reduce_scatter": True,
            "reduce_bucket_size": BUCKET_SIZE,
            "overlap_comm": on_gpu,  # overlaps gradient copies with backward; no gain without CUDA streams
            "contiguous_gradients": True,
        },
        "optimizer": {
            "type": "AdamW",  # with offload DeepSpeed picks DeepSpeedCPUAdam in AdamW mode
            "params": {"lr": cfg.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": cfg.weight_decay},
        },
    }
    if cfg.offload == "cpu":
        # pinned host buffers speed up transfers on a GPU; on a CPU-only machine there is nothing to pin for
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if precision == "fp16":
        ds["fp16"] = loss_scale_section()
    elif precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if cfg.optimizer_states != "fp32":  # 16-bit master, gradients, moments on the host (fitone.zero2.low_precision)
            ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if user:
        ds = merge(ds, user)
    if cfg.offload == "none":
        use_torch_adamw(ds, fused=on_gpu)
    return ds


def build_ds_config(run: Run) -> dict[str, Any]:
    """The DeepSpeed config of one engine: the run's sections with its batch sizes and schedule (a value the
    user's --ds-config sets wins, as everywhere)."""
    micro, accum = run.micro_batch, run.accumulation
    assert micro is not None and accum is not None, "an engine is built at a known micro-batch (Run.with_batch)"
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                          "train_batch_size": micro * accum * run.world_size}
    scheduler = lr_scheduler(run.settings, run.total_steps)
    if scheduler:
        ds["scheduler"] = scheduler
    return merge(ds, run.ds_sections)


def use_torch_adamw(ds: dict[str, Any], *, fused: bool) -> None:
    """With the optimizer on the GPU, take PyTorch's AdamW (fused kernels on CUDA) instead of DeepSpeed's
    FusedAdam: that one is JIT-compiled at the first engine, and DeepSpeed 0.19.8's build cannot parse
    Hopper's arch '9.0a', so --offload none failed on H100/H200 before the first step. DeepSpeed's own
    `torch_adam` switch builds torch.optim.AdamW from the same section (extra params are passed on), a
    ZeRO-2-tested optimizer. A --ds-config that picks another optimizer, or sets torch_adam, is kept."""
    optimizer = ds.get("optimizer") or {}
    params = optimizer.get("params") or {}
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw") or "torch_adam" in params:
        return
    optimizer["params"] = {**params, "torch_adam": True, "fused": fused}


def lr_scheduler(cfg: TrainConfig, total_steps: int | None) -> dict[str, Any] | None:
    """Linear warm-up, then linear or cosine decay to 0 when the run's length is known; constant without
    warm-up. DeepSpeed's own schedulers, so checkpoints carry their state."""
    steps = max(1, cfg.warmup_steps)  # DeepSpeed 0.19's schedulers refuse warmup_num_steps 0
    warm = {"warmup_min_lr": 0.0, "warmup_max_lr": cfg.lr, "warmup_num_steps": steps, "warmup_type": "linear"}
    total = max(total_steps or 0, cfg.warmup_steps + 1)
    if cfg.lr_schedule == "cosine" and total_steps:  # WarmupCosineLR takes ratios of the optimizer's lr
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total, "warmup_min_ratio": 0.0, "warmup_num_steps": steps, "cos_min_ratio": 0.0,
            "warmup_type": "linear"}}
    if cfg.lr_schedule == "linear" and total_steps:
        return {"type": "WarmupDecayLR", "params": {**warm, "total_num_steps": total}}
    if cfg.warmup_steps > 0:
        return {"type": "WarmupLR", "params": warm}
    return None


def read_user_config(path: str) -> dict[str, Any]:
    """A user's DeepSpeed JSON: must parse, be an object, and use only keys DeepSpeed knows."""
    try:
        values = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read --ds-config {path}: {exc.strerror}; give a readable JSON file") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--ds-config {path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix the file") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"--ds-config {path} must hold a JSON object of DeepSpeed settings")
    check_keys(values, KNOWN_TOP_LEVEL, f"--ds-config {path}")
    zero = values.get("zero_optimization")
    if isinstance(zero, dict):
        check_keys(zero, zero_config_keys(), f"zero_optimization of --ds-config {path}")
        if zero.get("stage", 2) != 2:
            raise ConfigError(f"--ds-config {path} sets ZeRO stage {zero['stage']}; fitone runs stage 2: "
                              "remove 'stage'")
    return values


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: `over` wins, nested dicts are merged key by key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
