"""One settings object for the CLI, the Python API and recipes.

`TrainConfig` owns every default. The CLI builds one from flags, a recipe from YAML; both go through
`TrainConfig.from_dict`, so an unknown key is always an error naming the nearest valid one.

Flags and YAML keys stay flat; a module that reads a few of them takes a section instead of the whole
settings: `cfg.data_settings()` (DataSettings), `schedule_settings()`, `memory_settings()`,
`run_dir_settings()` and `guard_settings()`, frozen copies of the fields of that name.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from fitone.errors import ConfigError
from fitone.units import parse_size

PRECISIONS = ("fp16", "bf16", "fp32", "auto")
OFFLOADS = ("cpu", "none")
DEVICES = ("auto", "cuda", "cpu")
LR_SCHEDULES = ("constant", "linear", "cosine")
REPORT_TO = ("tensorboard", "wandb")
PREFER_BATCH = ("throughput", "largest")  # what --batch-size auto and probe-batch choose (fitone.probe.choice)
# the optimizer's host state: fp32 (exact), or bf16 master weights and moments rounded stochastically (bf16)
# or to the nearest (bf16-nearest), or to the nearest with a bf16 compensation buffer (bf16-kahan), in the
# pipelined update (fitone.zero2.low_precision)
OPTIMIZER_STATES = ("fp32", "bf16", "bf16-nearest", "bf16-kahan")

def dividing(most: int, accumulation: Callable[[int], int]) -> Iterator[tuple[int, int]]:
    """(b, accumulation(b)) for b from `most` down to 1, skipping each b whose accumulation is refused
    (TrainConfig.accumulation: a global batch that b does not divide)."""
    for b in range(most, 0, -1):
        try:
            yield b, accumulation(b)
        except ConfigError:
            continue


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """'auto' (the default) is fp16 with loss scaling on a GPU and fp32 on the CPU, where DeepSpeed refuses fp16."""
    if precision != "auto":
        return precision
    return "fp16" if on_gpu else "fp32"


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that decides a run. Field names are the CLI's flag names with '-' for '_'."""

    # model
    model: str | None = None
    from_scratch: bool = False
    # data
    data: str = "sample"
    source_field: str = "source"
    target_field: str = "target"
    text_field: str = "text"
    prompt_field: str | None = None  # causal LM: a field fed before the text, not trained on
    src_len: int = 128
    tgt_len: int = 128
    seq_len: int = 512
    data_split: str = "train"  # a hub id's (or save_to_disk DatasetDict's) split that --data reads
    data_config: str | None = None  # a hub dataset's configuration (subset)
    chat_template: str | None = None  # a Jinja file for chat `messages` rows when the tokenizer has no template
    pack: bool = False  # causal LM: concatenate whole examples into full --seq-len rows
    cache: bool = True  # reuse datasets' cache of converted and tokenised data (False: redo both)
    eval_data: str | None = None  # held-out data with the same fields as --data ('sample' brings its own)
    eval_split: str | None = None  # --eval-data's split (hub id, DatasetDict); None: validation, else test
    eval_examples: int = 64
    eval_every: int | None = None  # also score the held-out set every N optimizer steps
    # batch and schedule
    batch_size: int | str = 8
    grad_accum: int | None = None
    global_batch: int | None = None
    prefer_batch: str = "throughput"  # --batch-size auto: the most samples/s, or the largest micro-batch
    lr: float = 1e-4
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_steps: int | None = None
    epochs: float = 1.0
    seed: int = 42
    # memory and precision
    precision: str = "auto"  # fp16 on a GPU, fp32 on the CPU (resolve_precision)
    activation_checkpointing: bool = True
    fused_loss: bool = True  # causal LMs: the LM head and cross-entropy fused, no [tokens, vocab] logits (fitone.loss)
    offload: str = "cpu"
    delayed_update: bool = False  # one-step delayed parameter update (fitone.zero2.overlap): CPU Adam beside the GPU
    delayed_update_after: int = 20  # plain steps first
    # the update pipelined into the next forward (fitone.zero2.overlap); None: on where it helps (one GPU, CPU
    # offload: fitone.zero2.step_mode), False: DeepSpeed's own step, True: asked for (an error where it cannot run)
    pipelined_update: bool | None = None
    optimizer_states: str = "fp32"  # one of OPTIMIZER_STATES; bf16 ones need --precision bf16 (fitone.zero2.step_mode)
    speculative_update: bool = False  # the pipelined update's Adam during the backward (fitone.zero2.speculative)
    gpu_adam_share: float = 0.0  # the pipelined update's Adam chunks stepped on the GPU (fitone.zero2.gpu_adam)
    ds_config: str | None = None
    max_gpu_memory: str | None = None
    expandable_segments: bool = True  # CUDA allocator: grow segments in place instead of fragmenting
    device: str = "auto"
    # run directory
    out: str | None = None
    save_every: int | None = None
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False
    log_every: int = 1
    report_to: str | None = None  # also log to: tensorboard, wandb or both (comma-separated); into --out
    verbose: bool = False
    progress: bool = True
    # numerical and memory guards
    preflight: bool = True  # stop early when the plan says host RAM cannot hold the offloaded states
    max_bad_steps: int = 20
    host_mem_warn: float = 0.90
    host_mem_stop: float = 0.95

    # filled by the recipe loader: where the values came from
    recipe: str | None = field(default=None, repr=False)
    # filled by the CLI: the options typed or in the recipe named, not defaults (TrainConfig always holds a
    # seq_len; fitone.run refuses a typed one for a seq2seq model once it has the model's config). No option.
    typed: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        """The option names (flags, YAML keys, keywords)."""
        return [f.name for f in fields(cls) if f.name != "typed"]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, where: str = "options") -> "TrainConfig":
        """Build from a mapping; unknown keys are an error naming the nearest valid key."""
        check_keys(values, cls.field_names(), where)
        return cls(**{k.replace("-", "_"): v for k, v in values.items()})

    def replace(self, **changes: Any) -> "TrainConfig":
        check_keys(changes, self.field_names(), "options")
        return dataclasses.replace(self, **changes)

    @classmethod
    def with_overrides(cls, cfg: "TrainConfig | None", overrides: Mapping[str, Any]) -> "TrainConfig":
        """What an API entry (train, probe_batch, plan) runs: a copy of `cfg` with `overrides`, or
        TrainConfig(**overrides); the caller's object is never changed."""
        return cfg.replace(**overrides) if cfg is not None else cls(**overrides)

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "typed"}

    # -- sections: what one module reads -----------------------------------------------------
    def data_settings(self) -> "DataSettings":
        return DataSettings.of(self)

    def schedule_settings(self) -> "ScheduleSettings":
        return ScheduleSettings.of(self)

    def memory_settings(self) -> "MemorySettings":
        return MemorySettings.of(self)

    def run_dir_settings(self) -> "RunDirSettings":
        return RunDirSettings.of(self)

    def guard_settings(self) -> "GuardSettings":
        return GuardSettings.of(self)

    # -- derived values -----------------------------------------------------------------------
    def accumulation(self, micro_batch: int, world_size: int = 1) -> int:
        """Gradient-accumulation steps: given, or derived from --global-batch."""
        if self.global_batch is None:
            return self.grad_accum or 1
        per_step = micro_batch * world_size
        if self.global_batch % per_step:
            nearest = max(per_step, round(self.global_batch / per_step) * per_step)
            raise ConfigError(
                f"--global-batch {self.global_batch} is not a multiple of micro-batch x GPUs = {per_step}: "
                f"use --global-batch {nearest} or another --batch-size"
            )
        return self.global_batch // per_step

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """The value checks: pure and cheap, so every construction and `replace` runs them. What reads the
        file system is check_paths(), run once where a run starts."""
        self._check_counts()
        self._check_held_out()
        if self.batch_size != "auto":
            if isinstance(self.batch_size, str) and self.batch_size.isdigit():
                self.batch_size = int(self.batch_size)
            _positive_int("batch_size", self.batch_size, hint="or 'auto' to probe for it")
        if self.grad_accum is not None and self.global_batch is not None:
            raise ConfigError("give --grad-accum or --global-batch, not both (one is derived from the other)")
        for name, choices in (("precision", PRECISIONS), ("lr_schedule", LR_SCHEDULES), ("offload", OFFLOADS),
                              ("prefer_batch", PREFER_BATCH), ("optimizer_states", OPTIMIZER_STATES)):
            _one_of(name, getattr(self, name), choices)
        self._check_update_modes()
        _one_of("device", self.device, DEVICES)
        self._check_schedule()
        if self.resume and self.overwrite:
            raise ConfigError("give --resume or --overwrite, not both")
        if not 0 < self.host_mem_warn <= self.host_mem_stop <= 1:
            raise ConfigError("host-memory thresholds need 0 < --host-mem-warn <= --host-mem-stop <= 1, "
                              "e.g. 0.9 and 0.95")
        parse_size(self.max_gpu_memory, "--max-gpu-memory")
        self._check_report_to()

    def check_paths(self) -> None:
        """The checks that read the file system (the files the options name, an optional package installed):
        run once where a run starts (train, probe_batch, plan), never on a `replace`."""
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"--chat-template {self.chat_template}: no such file; give a Jinja chat template file")
        if "wandb" in self.report_sinks:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("--report-to wandb needs the wandb package: pip install wandb")
        if self.ds_config is not None and not Path(self.ds_config).is_file():
            raise ConfigError(f"--ds-config {self.ds_config}: no such file; give the path of a DeepSpeed JSON file")

    def _check_counts(self) -> None:
        for name in ("src_len", "tgt_len", "seq_len", "keep_checkpoints", "log_every", "max_bad_steps"):
            _positive_int(name, getattr(self, name))
        for name in ("grad_accum", "global_batch", "max_steps", "save_every", "eval_every"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.eval_examples < 0:
            raise ConfigError("--eval-examples must be 0 or more")

    def _check_held_out(self) -> None:
        if self.prompt_field is not None and self.prompt_field == self.text_field:
            raise ConfigError(f"--prompt-field and --text-field are both {self.text_field!r}: the prompt is fed "
                              "before the text, so name two different fields")
        if self.eval_data and self.eval_examples == 0:
            raise ConfigError("--eval-data is scored on --eval-examples held-out examples: give --eval-examples "
                              "above 0, or drop --eval-data")
        if self.eval_every is not None and self.eval_examples == 0:
            raise ConfigError("--eval-every scores --eval-examples held-out examples: give --eval-examples above 0")

    def _check_update_modes(self) -> None:
        if self.pipelined_update == "auto":  # a recipe or key=value may spell the default out
            self.pipelined_update = None
        if self.pipelined_update not in (None, True, False):
            raise ConfigError(f"pipelined_update must be true, false or auto, got {self.pipelined_update!r}")
        if self.delayed_update and self.pipelined_update:
            raise ConfigError("give --delayed-update or --pipelined-update, not both")
        for flag, on in (("--delayed-update", self.delayed_update), ("--pipelined-update", self.pipelined_update)):
            if on and self.offload != "cpu":
                raise ConfigError(f"{flag} overlaps the CPU optimizer with the GPU: it needs --offload cpu")
        if self.optimizer_states != "fp32" and self.offload != "cpu":
            raise ConfigError(f"--optimizer-states {self.optimizer_states} keeps ZeRO-2's offloaded optimizer state in "
                              "16 bits on the host: it needs --offload cpu")
        if self.speculative_update:
            self._check_speculative_update()
        if not 0 <= self.gpu_adam_share < 1:
            raise ConfigError(f"--gpu-adam-share is the fraction of the CPU Adam's chunks the GPU steps, from 0 "
                              f"(none) up to but not including 1, got {self.gpu_adam_share}")
        if self.gpu_adam_share and not self.takes_gpu_adam_share():
            raise ConfigError("--gpu-adam-share shares the pipelined update's fp32 CPU Adam with the GPU: it needs "
                              "--offload cpu and --optimizer-states fp32, without --delayed-update or "
                              "--no-pipelined-update")
        if self.delayed_update_after < 0:
            raise ConfigError(f"--delayed-update-after must be 0 or more, got {self.delayed_update_after}")

    def takes_gpu_adam_share(self) -> bool:
        """Whether these settings run the pipelined update's fp32 CPU Adam, which --gpu-adam-share shares."""
        return (self.offload == "cpu" and self.optimizer_states == "fp32" and not self.delayed_update
                and self.pipelined_update is not False)

    def _check_speculative_update(self) -> None:
        flag = "--speculative-update"  # the pipelined update's exact mode, run early (fitone.zero2.speculative)
        if self.offload != "cpu":
            raise ConfigError(f"{flag} runs the CPU optimizer's Adam during the backward: it needs --offload cpu")
        if self.delayed_update:
            raise ConfigError(f"{flag} runs in the pipelined update, not the delayed update: drop one of them")
        if self.optimizer_states != "fp32":
            raise ConfigError(f"{flag} runs on the exact mode's states: give --optimizer-states fp32, or drop it")
        if self.pipelined_update is False:
            raise ConfigError(f"{flag} runs in the pipelined update: drop --no-pipelined-update, or drop {flag}")

    def _check_schedule(self) -> None:
        if not (self.lr > 0):
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not (self.epochs > 0):
            raise ConfigError(f"--epochs must be positive, got {self.epochs}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("--warmup-steps, --weight-decay and --grad-clip cannot be negative")

    def _check_report_to(self) -> None:
        names = self.report_sinks
        for name in names:
            if name not in REPORT_TO:
                raise ConfigError(f"--report-to takes {', '.join(REPORT_TO)} (comma-separated), got {name!r}")
        if names and self.out is None:
            raise ConfigError(f"--report-to {self.report_to} writes into the run directory: add --out DIR")

    @property
    def report_sinks(self) -> list[str]:
        """--report-to as a list (a recipe may give a YAML list)."""
        value = self.report_to
        items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
        return [s.strip() for s in items if s.strip() and s.strip() != "none"]


@dataclass(frozen=True, kw_only=True)
class _Section:
    """A frozen copy of some TrainConfig fields, same names and types (tests/test_config.py checks them):
    TrainConfig keeps the defaults and the checks, a section only carries the values."""

    @classmethod
    def of(cls, cfg: TrainConfig) -> Any:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True, kw_only=True)
class DataSettings(_Section):
    """What fitone.data reads: the sources, their fields, the lengths, and how datasets caches and reports."""

    model: str | None  # named in the refusals of causal-only options on a seq2seq model
    data: str
    source_field: str
    target_field: str
    text_field: str
    prompt_field: str | None
    src_len: int
    tgt_len: int
    seq_len: int
    data_split: str
    data_config: str | None
    chat_template: str | None
    pack: bool
    cache: bool
    eval_data: str | None
    eval_split: str | None
    seed: int  # synthetic tokens and the worst-case batch
    verbose: bool
    progress: bool


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings(_Section):
    """Batches, the learning-rate schedule and how long a run trains."""

    batch_size: int | str
    grad_accum: int | None
    global_batch: int | None
    lr: float
    warmup_steps: int
    lr_schedule: str
    weight_decay: float
    grad_clip: float
    max_steps: int | None
    epochs: float
    seed: int


@dataclass(frozen=True, kw_only=True)
class MemorySettings(_Section):
    """Where the weights, gradients and optimizer states live, at what precision, on which device."""

    precision: str
    activation_checkpointing: bool
    fused_loss: bool
    offload: str
    delayed_update: bool
    delayed_update_after: int
    pipelined_update: bool | None
    optimizer_states: str
    speculative_update: bool
    gpu_adam_share: float
    ds_config: str | None
    max_gpu_memory: str | None
    expandable_segments: bool
    device: str


@dataclass(frozen=True, kw_only=True)
class RunDirSettings(_Section):
    """The run directory: checkpoints, resuming, logs and where else they go."""

    out: str | None
    save_every: int | None
    keep_checkpoints: int
    resume: bool
    overwrite: bool
    log_every: int
    report_to: str | None
    verbose: bool
    progress: bool


@dataclass(frozen=True, kw_only=True)
class GuardSettings(_Section):
    """The numerical and memory guards that stop a run early."""

    preflight: bool
    max_bad_steps: int
    host_mem_warn: float
    host_mem_stop: float


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got {value!r}")


def _positive_int(name: str, value: Any, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        flag = "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} must be a positive whole number{', ' + hint if hint else ''}; got {value!r}")


def check_keys(values: Mapping[str, Any], valid: list[str], where: str) -> None:
    """Raise ConfigError for the first unknown key, naming the closest valid one."""
    for key in values:
        norm = key.replace("-", "_")
        if norm not in valid:
            near = difflib.get_close_matches(norm, valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(valid)}"
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")
