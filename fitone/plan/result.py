"""A memory plan as data: its components (bytes, in named categories) and the Plan that holds them; the
arithmetic that makes them is fitone.plan.components'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fitone import checkpoint, hf_export
from fitone.units import gib, parse_size

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")


@dataclass
class Component:
    name: str
    category: str  # one of CATEGORIES
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """Predicted memory of one run. Bytes throughout; `to_dict()` adds GiB."""

    model: str
    family: str
    n_params: int
    precision: str
    offload: bool
    gpus: int  # ranks on each node (--gpus): host_total is one node's, these ranks' shares
    world_size: int  # ranks over every node (--gpus x --nodes): what ZeRO-2 partitions over
    nodes: int  # machines (--nodes), `gpus` ranks on each
    micro_batch: int
    lengths: dict[str, int]
    activation_checkpointing: bool
    gpu: list[Component]  # per rank
    host: list[Component]  # per rank
    gpu_total: int
    host_total: int  # one node's: its `gpus` ranks
    gpu_limit: int | None  # what gpu_total is compared with (card memory, or allocator cap + CUDA context)
    gpu_limit_source: str
    host_available: int
    activation_per_sample: int  # with the configured checkpointing
    activation_per_sample_ckpt: int
    activation_per_sample_no_ckpt: int
    max_micro_batch: int | None  # largest fitting the GPU limit at the run's accumulation (0: none); None: no limit
    max_micro_batch_without_offload: int | None
    gpu_total_without_offload: int
    host_total_without_offload: int
    verdict: str
    short: dict[str, int] = field(default_factory=dict)  # resource -> bytes missing
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deepspeed_estimate: dict[str, int] | None = None
    gpu_init: list[Component] = field(default_factory=list)  # per rank, at the engine's init
    optimizer_states: str = "fp32"  # --optimizer-states
    # host_total of the same run under --optimizer-states bf16 (None: not planned: asked for already, no CPU
    # offload, or several ranks, where the 16-bit step does not run)
    host_total_16bit_states: int | None = None
    max_micro_batch_one_step: int | None = None  # max_micro_batch at one micro-batch a step (accumulating holds more)

    @property
    def gpu_init_total(self) -> int:
        return sum(c.bytes for c in self.gpu_init)

    @property
    def gpu_peak(self) -> int:
        """What the GPU must hold at the run's worst moment: the engine's init or a training step."""
        return max(self.gpu_total, self.gpu_init_total)

    @property
    def gpu_peak_phase(self) -> str:
        """Which phase sets `gpu_peak` (and so the GPU verdict): "step" or "engine init"."""
        return "engine init" if self.gpu_init_total > self.gpu_total else "step"

    @property
    def gpu_allocated(self) -> int:
        """Peak bytes the CUDA allocator hands out (what torch.cuda.max_memory_allocated reports)."""
        return sum(c.bytes for c in self.gpu if c.category != "overhead")

    @property
    def host_export(self) -> int:
        """Host RAM while `final/` is written: the steps' and one export shard, which is all the streamed export
        holds (fitone.hf_export.export; measured: bench/results/2026-12-01-issue27/llama-3.1-8b/)."""
        return self.host_total + int(parse_size(hf_export.EXPORT_SHARD_SIZE, "shard size"))

    @property
    def host_export_16bit_states(self) -> int | None:
        """`host_export` under --optimizer-states bf16 (None where host_total_16bit_states is)."""
        if self.host_total_16bit_states is None:
            return None
        return self.host_export - self.host_total + self.host_total_16bit_states

    @property
    def checkpoint_bytes(self) -> int:
        """Disk bytes of one `--save-every` checkpoint of this model (fitone.checkpoint.checkpoint_bytes)."""
        return checkpoint.checkpoint_bytes(self.n_params, self.precision, self.optimizer_states)

    @property
    def host_states(self) -> int:
        """Host bytes of one rank beyond the process baseline: what offloading adds."""
        return sum(c.bytes for c in self.host if c.name != "process baseline")

    def by_category(self, where: str) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for c in getattr(self, where):
            out[c.category] += c.bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values: bytes, and GiB rounded to 3 decimals (`fitone plan --json`)."""

        def comps(items: list[Component]) -> list[dict[str, Any]]:
            return [{"name": c.name, "category": c.category, "bytes": c.bytes, "gib": _g(c.bytes), "note": c.note}
                    for c in items]

        return {
            "model": self.model, "family": self.family, "n_params": self.n_params, "precision": self.precision,
            "optimizer_states": self.optimizer_states,
            "host_export_16bit_states_gib": None if self.host_export_16bit_states is None
            else _g(self.host_export_16bit_states),
            "offload": "cpu" if self.offload else "none", "gpus": self.gpus, "nodes": self.nodes,
            "world_size": self.world_size, "micro_batch": self.micro_batch,
            "lengths": self.lengths, "activation_checkpointing": self.activation_checkpointing,
            "gpu_gib": _g(self.gpu_total), "gpu_allocated_gib": _g(self.gpu_allocated),
            "host_gib": _g(self.host_total), "host_per_rank_gib": _g(sum(c.bytes for c in self.host)),
            "host_export_gib": _g(self.host_export),
            "checkpoint_gib": _g(self.checkpoint_bytes), "gpu_init_gib": _g(self.gpu_init_total),
            "gpu_peak_gib": _g(self.gpu_peak), "gpu_peak_phase": self.gpu_peak_phase,
            "gpu_limit_gib": None if self.gpu_limit is None else _g(self.gpu_limit),
            "gpu_limit_source": self.gpu_limit_source, "host_available_gib": _g(self.host_available),
            "components": {"gpu": comps(self.gpu), "gpu_init": comps(self.gpu_init), "host": comps(self.host)},
            "categories_gib": {w: {k: _g(v) for k, v in self.by_category(w).items()} for w in ("gpu", "host")},
            "activation_per_sample_gib": _g(self.activation_per_sample),
            "activation_per_sample_ckpt_gib": _g(self.activation_per_sample_ckpt),
            "activation_per_sample_no_ckpt_gib": _g(self.activation_per_sample_no_ckpt),
            "max_micro_batch": self.max_micro_batch, "max_micro_batch_one_step": self.max_micro_batch_one_step,
            "max_micro_batch_without_offload": self.max_micro_batch_without_offload,
            "gpu_gib_without_offload": _g(self.gpu_total_without_offload),
            "host_gib_without_offload": _g(self.host_total_without_offload),
            "verdict": self.verdict, "short_gib": {k: _g(v) for k, v in self.short.items()},
            "suggestions": self.suggestions, "notes": self.notes,
            "deepspeed_estimate_gib": None if self.deepspeed_estimate is None
            else {k: _g(v) for k, v in self.deepspeed_estimate.items()},
        }

    # A notebook's conveniences (README, examples/quickstart.ipynb): fitone's own callers draw through render,
    # which imports nothing of the plan at run time, so these two imports close no cycle
    def __str__(self) -> str:
        from fitone.render import plan_text  # on call: render, the layer above, draws the plan

        return plan_text(self)

    def plot(self, path: str) -> str:
        """Stacked bars of where memory goes on the GPU and the host, with the limit drawn in (a PNG)."""
        from fitone.render import plot_plan  # on call: render, the layer above, draws the plan

        return str(plot_plan(self, path))


def _g(n: float) -> float:
    """GiB as a plan shows them (3 decimals): the advice and the pre-flight's messages round the same way."""
    return gib(n, 3)
