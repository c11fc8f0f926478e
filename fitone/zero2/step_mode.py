"""Which optimizer step a run takes: DeepSpeed's own, the pipelined update or the delayed one (`overlap`).

Decided once per run (`decide`, called by fitone.run's `resolve` with the run's DeepSpeed sections, world size
and device) and handed as a `StepMode` to the engine, the probe and the plan. Pipelined is the default where it
is measured faster and trains the same (bench/NOTES.md): one GPU, DeepSpeedCPUAdam on the CPU. Several ranks take
it when asked (--pipelined-update: CPU-tested, not yet measured on GPUs), DeepSpeed's step by default. The
16-bit optimizer states (--optimizer-states bf16) run in the pipelined update only, on one rank, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fitone.errors import ConfigError

DEEPSPEED, PIPELINED, DELAYED = "deepspeed", "pipelined", "delayed"
# DeepSpeed's names for a dtype in its config (deepspeed.runtime.config_utils.DtypeEnum)
_DTYPE_NAMES = {"fp32": {"fp32", "float32", "float", "torch.float32"},
                "fp16": {"fp16", "float16", "half", "torch.float16"},
                "bf16": {"bf16", "bfloat16", "bfloat", "torch.bfloat16"}}


@dataclass(frozen=True)
class StepMode:
    one_gpu: str  # the step these settings take on one GPU: what a probe of them runs and records
    world_size: int = 1
    delayed_after: int = 0  # the delayed update's plain steps first
    states: str = "fp32"  # the optimizer's host state (fitone.config.OPTIMIZER_STATES)
    rounding_seed: int = 0  # keys stochastic rounding's bits (fitone.zero2.low_precision)
    speculative: bool = False  # the pipelined update's Adam during the backward (fitone.zero2.speculative)
    on_ranks: bool = False  # --pipelined-update under a launcher: the pipelined update on every rank (opt-in)
    gpu_share: float = 0.0  # the pipelined update's Adam chunks stepped on the GPU (fitone.zero2.gpu_adam)

    @property
    def name(self) -> str:
        """The step this run takes: several ranks keep DeepSpeed's unless the pipelined update is asked for
        (it gathers each updated chunk beside the forward, fitone.zero2.ranks; no GPU measurement yet)."""
        if self.one_gpu == PIPELINED and self.world_size > 1 and not self.on_ranks:
            return DEEPSPEED
        return self.one_gpu

    def on_one_gpu(self) -> StepMode:
        """The same settings as a one-GPU probe runs them."""
        return replace(self, world_size=1)

    def engine_options(self) -> dict[str, Any]:
        """fitone.engine.Engine's keyword arguments: training and the probe build the same engine, so a
        probe's trials hold what training will hold (the pipelined update's upload chunks)."""
        return {"delayed_after": self.delayed_after if self.name == DELAYED else None,
                "pipelined": self.name == PIPELINED, "states": self.states, "rounding_seed": self.rounding_seed,
                "speculative": self.speculative and self.name == PIPELINED,
                "gpu_share": self.gpu_share if self.name == PIPELINED else 0.0}


def decide(ds: dict[str, Any], *, delayed_update: bool, delayed_update_after: int, pipelined_update: bool | None,
           world_size: int, on_gpu: bool, optimizer_states: str = "fp32", seed: int = 0,
           speculative_update: bool = False, gpu_adam_share: float = 0.0) -> StepMode:
    """The step for these flags and `ds` (the DeepSpeed config, the user's --ds-config merged in); a flag that
    cannot be honoured is a ConfigError. A CPU device (nothing to overlap with) and a `ds` that moves the
    optimizer off the CPU, swaps in torch.optim's Adam or sums the gradients in another dtype than the weights'
    (data_types.grad_accum_dtype) keep DeepSpeed's step unless one is asked for."""
    optimizer = ds.get("optimizer") or {}
    # both overlapped modes run DeepSpeedCPUAdam's Adam(W) on its own states; torch_adam swaps in torch.optim's
    cpu_adam = (str(optimizer.get("type", "")).lower() in ("adam", "adamw")
                and not (optimizer.get("params") or {}).get("torch_adam"))
    asked = "--delayed-update" if delayed_update else "--pipelined-update" if pipelined_update else None
    if asked and not cpu_adam:
        raise ConfigError(f"{asked} runs DeepSpeedCPUAdam's Adam/AdamW: drop the optimizer's type or torch_adam "
                          "from --ds-config, or drop the flag")
    lean = not _sums_in_another_dtype(ds)  # the pipelined update's host layout holds the sums' dtype only
    if pipelined_update and not lean:
        raise ConfigError("--pipelined-update keeps the gradients in the weights' dtype, which DeepSpeed sums them "
                          "in: drop data_types.grad_accum_dtype from --ds-config, or drop the flag")
    if optimizer_states != "fp32" or (ds.get("bf16") or {}).get("bf16_master_weights_and_grads"):
        _check_16bit_states(ds, optimizer_states, cpu_adam=cpu_adam, lean=lean, delayed_update=delayed_update,
                            pipelined_update=pipelined_update, world_size=world_size)
        _check_speculative(speculative_update, PIPELINED, world_size, optimizer_states)
        return StepMode(one_gpu=PIPELINED, world_size=world_size, states=optimizer_states, rounding_seed=seed)
    if delayed_update:
        one_gpu = DELAYED
    elif pipelined_update is not None:
        one_gpu = PIPELINED if pipelined_update else DEEPSPEED
    else:
        zero = ds.get("zero_optimization") or {}
        offloaded = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
        one_gpu = PIPELINED if on_gpu and offloaded and cpu_adam and lean else DEEPSPEED
    _check_speculative(speculative_update, one_gpu, world_size, optimizer_states)
    # a CPU run has no GPU to share with (a recipe's share is for its GPU runs), nor has a launcher's rank
    share = gpu_adam_share if on_gpu and world_size == 1 and one_gpu == PIPELINED else 0.0
    return StepMode(one_gpu=one_gpu, world_size=world_size, delayed_after=delayed_update_after,
                    speculative=speculative_update, on_ranks=bool(pipelined_update) and world_size > 1,
                    gpu_share=share)


def _check_speculative(asked: bool, one_gpu: str, world_size: int, states: str) -> None:
    """--speculative-update runs in the pipelined update's exact mode on one GPU, and only there."""
    if not asked:
        return
    if states != "fp32":
        raise ConfigError(f"--speculative-update runs on the exact mode's states: drop --optimizer-states {states}, "
                          "or drop --speculative-update")
    if world_size > 1:
        raise ConfigError("--speculative-update runs in the pipelined update, on one GPU: drop it under a launcher")
    if one_gpu != PIPELINED:
        raise ConfigError("--speculative-update runs in the pipelined update, which this run does not take: give "
                          "--pipelined-update (it needs DeepSpeedCPUAdam on --offload cpu), or drop "
                          "--speculative-update")


def _check_16bit_states(ds: dict[str, Any], states: str, *, cpu_adam: bool, lean: bool, delayed_update: bool,
                        pipelined_update: bool | None, world_size: int) -> None:
    """16-bit optimizer states run in the pipelined update on the lean layout (its bf16 buffers are DeepSpeed's
    bf16_master_weights_and_grads and bf16_optimizer_states, which ds_config.sections sets): the rest is refused."""
    flag = f"--optimizer-states {states}"
    if states == "fp32":
        raise ConfigError("--ds-config sets bf16.bf16_master_weights_and_grads: drop it and give --optimizer-states "
                          "bf16 (fitone's 16-bit step runs on those buffers)")
    if not (ds.get("bf16") or {}).get("enabled"):
        trained = "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32"
        raise ConfigError(f"{flag} needs --precision bf16 ({trained} training given): DeepSpeed keeps 16-bit master "
                          "weights and gradients in bf16 only for bf16 weights, so fp16 and fp32 runs keep "
                          "--optimizer-states fp32")
    zero = ds.get("zero_optimization") or {}
    if (zero.get("offload_optimizer") or {}).get("device") != "cpu" or not cpu_adam or not lean:
        raise ConfigError(f"{flag} runs on ZeRO-2's CPU offload with DeepSpeedCPUAdam, the gradients summed in the "
                          "weights' dtype: drop offload_optimizer, the optimizer or data_types from --ds-config")
    if delayed_update or pipelined_update is False:
        raise ConfigError(f"{flag} runs in the pipelined update: drop "
                          f"{'--delayed-update' if delayed_update else '--no-pipelined-update'}")
    if world_size > 1:
        raise ConfigError(f"{flag} runs in the pipelined update, on one GPU: drop it under a launcher")


def _sums_in_another_dtype(ds: dict[str, Any]) -> bool:
    """Whether `ds` has DeepSpeed sum the micro-batches' gradients in a dtype other than the weights'."""
    summed = (ds.get("data_types") or {}).get("grad_accum_dtype")
    weights = next((p for p in ("bf16", "fp16") if (ds.get(p) or {}).get("enabled")), "fp32")
    return summed is not None and str(summed).lower() not in _DTYPE_NAMES[weights]
