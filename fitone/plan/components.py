"""What each piece of a ZeRO-2 run holds on the GPU and in host RAM, in bytes: the component arithmetic.

Model states follow what DeepSpeed 0.19's `deepspeed/runtime/zero/stage_1_and_2.py` allocates (line
numbers cited below).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from fitone import memory
from fitone.plan.activations import Lengths, activation_bytes
from fitone.plan.shape import ModelShape
from fitone.units import GIB

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")

CUDA_CONTEXT = GIB // 2  # the CUDA context and kernels live outside the allocator (and outside any cap)
FRAGMENTATION = 0.05  # the caching allocator reserves a little more than it hands out
# What the process holds before any model state: python + torch + transformers + DeepSpeed (+ CUDA libs).
# CPU: 0.4 GiB measured here for the imports. GPU box: 1.2 GiB measured on the H200 after CUDA init;
# ANCHORS' t5-3b run settled at 63.4 GiB RSS = 61.25 GiB of states below + ~2 GiB.
BASELINE_GPU_BOX = 2 * GIB
BASELINE_CPU = GIB // 2


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
    gpus: int
    micro_batch: int
    lengths: dict[str, int]
    activation_checkpointing: bool
    gpu: list[Component]  # per rank
    host: list[Component]  # per rank
    gpu_total: int
    host_total: int  # all ranks on this host
    gpu_limit: int | None  # what gpu_total is compared with (card memory, or allocator cap + CUDA context)
    gpu_limit_source: str
    host_available: int
    activation_per_sample: int  # with the configured checkpointing
    activation_per_sample_ckpt: int
    activation_per_sample_no_ckpt: int
    max_micro_batch: int | None  # largest that fits the GPU limit (0: not even 1); None without a limit
    max_micro_batch_without_offload: int | None
    gpu_total_without_offload: int
    host_total_without_offload: int
    verdict: str
    short: dict[str, int] = field(default_factory=dict)  # resource -> bytes missing
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deepspeed_estimate: dict[str, int] | None = None

    @property
    def gpu_allocated(self) -> int:
        """Peak bytes the CUDA allocator hands out (what torch.cuda.max_memory_allocated reports)."""
        return sum(c.bytes for c in self.gpu if c.category != "overhead")

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
        def comps(items: list[Component]) -> list[dict[str, Any]]:
            return [{"name": c.name, "category": c.category, "bytes": c.bytes, "gib": _g(c.bytes), "note": c.note}
                    for c in items]

        return {
            "model": self.model, "family": self.family, "n_params": self.n_params, "precision": self.precision,
            "offload": "cpu" if self.offload else "none", "gpus": self.gpus, "micro_batch": self.micro_batch,
            "lengths": self.lengths, "activation_checkpointing": self.activation_checkpointing,
            "gpu_gib": _g(self.gpu_total), "gpu_allocated_gib": _g(self.gpu_allocated), "host_gib": _g(self.host_total),
            "gpu_limit_gib": None if self.gpu_limit is None else _g(self.gpu_limit),
            "gpu_limit_source": self.gpu_limit_source, "host_available_gib": _g(self.host_available),
            "components": {"gpu": comps(self.gpu), "host": comps(self.host)},
            "categories_gib": {w: {k: _g(v) for k, v in self.by_category(w).items()} for w in ("gpu", "host")},
            "activation_per_sample_gib": _g(self.activation_per_sample),
            "activation_per_sample_ckpt_gib": _g(self.activation_per_sample_ckpt),
            "activation_per_sample_no_ckpt_gib": _g(self.activation_per_sample_no_ckpt),
            "max_micro_batch": self.max_micro_batch,
            "max_micro_batch_without_offload": self.max_micro_batch_without_offload,
            "gpu_gib_without_offload": _g(self.gpu_total_without_offload),
            "host_gib_without_offload": _g(self.host_total_without_offload),
            "verdict": self.verdict, "short_gib": {k: _g(v) for k, v in self.short.items()},
            "suggestions": self.suggestions, "notes": self.notes,
            "deepspeed_estimate_gib": None if self.deepspeed_estimate is None
            else {k: _g(v) for k, v in self.deepspeed_estimate.items()},
        }

    def __str__(self) -> str:
        mode = "ZeRO-2 + CPU offload" if self.offload else "ZeRO-2, no offload"
        lens = " / ".join(f"{k} {v}" for k, v in self.lengths.items())
        lines = [
            f"{self.model}: {self.n_params / 1e9:.3g}B params ({self.family} formula), {self.precision}, {mode}, "
            f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}",
            f"micro-batch {self.micro_batch}, {lens}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}",
            "",
        ]
        width = max(len(c.name) for c in self.gpu + self.host) + 2
        for title, items, total, limit, limit_name in (
            ("GPU, per rank", self.gpu, self.gpu_total, self.gpu_limit, self.gpu_limit_source),
            ("host" + (f", per rank (x{self.gpus} ranks in the total)" if self.gpus > 1 else ""), self.host,
             self.host_total, self.host_available, "available"),
        ):
            lines.append(f"{title:<{width}}{'GiB':>8}")
            lines += [f"  {c.name:<{width - 2}}{_g(c.bytes):>8.2f}   {c.note}".rstrip() for c in items]
            of = "" if limit is None else f" of {_g(limit):.2f} ({limit_name})"
            lines += [f"  {'total':<{width - 2}}{_g(total):>8.2f}{of}", ""]
        act = (f"activations per sample: {self.activation_per_sample_ckpt / 2**20:.1f} MiB with checkpointing, "
               f"{self.activation_per_sample_no_ckpt / 2**20:.1f} MiB without")
        lines.append(act)
        if self.max_micro_batch is not None:
            lines.append(f"largest micro-batch that fits: {self.max_micro_batch} "
                         f"(without offload: {self.max_micro_batch_without_offload})")
        lines.append(f"without offload: GPU {_g(self.gpu_total_without_offload):.2f} GiB, "
                     f"host {_g(self.host_total_without_offload):.2f} GiB")
        if self.deepspeed_estimate:
            ds = self.deepspeed_estimate
            lines.append(f"DeepSpeed's own estimate (model states only): GPU {_g(ds['gpu']):.2f} GiB, "
                         f"host {_g(ds['host']):.2f} GiB")
        lines += ["", f"verdict: {self.verdict}"]
        lines += [f"  short of {k} memory by {_g(v):.2f} GiB" for k, v in self.short.items()]
        if self.suggestions:
            lines += ["what would help:"] + [f"  - {s}" for s in self.suggestions]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Stacked bars of where memory goes on the GPU and the host, with the limit drawn in.

        Drawn on a bare Figure with the Agg canvas, so a notebook's pyplot backend is left alone.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        colors = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
        fig = Figure(figsize=(9, 5.5))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 2)
        panels = (("GPU (per rank)", "gpu", self.gpu_total, self.gpu_limit, "limit"),
                  ("host" + (f" ({self.gpus} ranks)" if self.gpus > 1 else ""), "host", self.host_total,
                   self.host_available, "available"))
        for ax, (title, where, total, limit, limit_name) in zip(axes, panels):
            scale = self.gpus if where == "host" else 1
            top = max(_g(total), _g(limit) if limit else 0.0)
            bottom = 0.0
            for cat, value in self.by_category(where).items():
                gib_value = _g(value * scale)
                ax.bar([0], [gib_value], bottom=bottom, color=colors[cat], width=0.5, label=cat)
                if gib_value > 0.05 * top:  # small slices are left to the legend
                    ax.text(0, bottom + gib_value / 2, f"{cat} {gib_value:.1f}", ha="center", va="center",
                            fontsize=8, color="white")
                bottom += gib_value
            if limit:
                ax.axhline(_g(limit), color="black", linestyle="--", linewidth=1.2)
                ax.text(-0.58, _g(limit), f"{limit_name} {_g(limit):.1f} GiB", va="bottom", ha="left", fontsize=8)
            ax.set_xlim(-0.6, 0.6)
            ax.set_ylim(0, top * 1.12 or 1)
            ax.set_xticks([0], [f"total {_g(total):.1f} GiB"])
            ax.set_ylabel("GiB")
            ax.set_title(title)
        axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, title="category")
        fig.suptitle(f"{self.model}, {self.precision}, micro-batch {self.micro_batch}: {self.verdict}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return str(path)


def _g(n: float) -> float:
    return round(n / GIB, 3)


def _pow2(n: int) -> int:
    """PyTorch's pinned-memory allocator rounds each block up to a power of two (CachingHostAllocator.h)."""
    return 1 << max(0, (int(n) - 1).bit_length())


# -- one mode's components --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    """Everything the component arithmetic reads, from TrainConfig plus the generated DeepSpeed config."""

    shape: ModelShape
    precision: str
    checkpointing: bool
    lengths: Lengths
    gpus: int
    accumulation: int
    bucket: int  # reduce_bucket_size, elements
    overlap_comm: bool
    pin_memory: bool
    on_gpu: bool
    delayed_update: bool = False  # a second fp32 gradient buffer (fitone.zero2.overlap)
    pipelined_update: bool = False  # two fp32 upload chunks on the GPU (fitone.zero2.overlap)

    @property
    def w(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def per_sample(self, checkpointing: bool | None = None) -> int:
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        return activation_bytes(self.shape, precision=self.precision, checkpointing=ckpt, lengths=self.lengths)


def _gpu_components(st: _Setup, offload: bool, micro_batch: int) -> list[Component]:
    s, w, n = st.shape, st.w, st.gpus
    part = math.ceil(s.n_params / n)
    bits = "fp32" if w == 4 else "16-bit"
    comps = [Component("weights", "weights", w * s.n_params, f"{bits}, {w} B/param (bit16_groups_flat, line 505)")]
    nbuf = 2 if st.overlap_comm else 1
    comps.append(Component("gradient buckets", "gradients", nbuf * st.bucket * w,
                           f"{nbuf} x reduce_bucket_size {st.bucket:.2g} ({'overlap_comm' if nbuf == 2 else 'one'}"
                           ", setup_buckets, lines 3266-3278)"))
    largest = s.largest_param
    if offload:
        upcast = 4 * largest if w < 4 else 0
        comps.append(Component("offload staging", "buffers", 2 * w * largest + upcast,
                               "largest param: temp_grad_buffer_for_gpu_offload (line 659), its autograd grad"
                               + (", fp32 copy for the CPU (line 1898)" if upcast else "")))
        if st.pipelined_update and st.on_gpu:
            from fitone.zero2.overlap import UPLOAD_CHUNK

            comps.append(Component("pipelined-update landing", "buffers", 2 * 4 * min(UPLOAD_CHUNK, part),
                                   "two fp32 chunks: the updated master goes up and is cast on the GPU"))
    else:
        comps.append(Component("gradient partition", "gradients", w * part,
                               f"{bits} grads of this rank's partition (grads_in_partition, line 2192)"))
        comps.append(Component("optimizer states", "optimizer", 12 * part,
                               "fp32 master (line 560) + Adam m, v, on the GPU"))
        comps.append(Component("largest grad", "buffers", w * largest, "autograd's grad before the bucket copy"))
    comps.append(Component("activations", "activations", st.per_sample() * micro_batch,
                           f"{micro_batch} x {st.per_sample() / 2**20:.1f} MiB"))
    if not offload:  # step: fp32 grads of the partition exist once activations are gone (flatten in step())
        backward = sum(c.bytes for c in comps)
        step = backward - comps[-1].bytes + 4 * part
        if step > backward:
            comps.append(Component("step fp32 grads", "buffers", step - backward,
                                   "optimizer step's fp32 grad partition beyond the backward peak"))
    allocated = sum(c.bytes for c in comps)
    if st.on_gpu:
        comps.append(Component("CUDA context", "overhead", CUDA_CONTEXT, "outside the allocator"))
    comps.append(Component("fragmentation margin", "overhead", int(FRAGMENTATION * allocated),
                           f"{FRAGMENTATION:.0%} of allocated"))
    return comps


def _host_components(st: _Setup, offload: bool) -> list[Component]:
    s, w, n = st.shape, st.w, st.gpus
    part = math.ceil(s.n_params / n)
    baseline = BASELINE_GPU_BOX if st.on_gpu else BASELINE_CPU
    if not offload:
        return [Component("model load", "weights", 4 * s.n_params, "fp32 weights on the CPU before they move"),
                Component("process baseline", "overhead", baseline, "python, torch, CUDA, DeepSpeed")]
    if st.pipelined_update:  # the lean host layout (fitone.zero2.layout): the arithmetic's 16 B/param, little else
        from fitone.zero2.layout import GROUP_ELEMENTS

        return [
            Component("fp32 master weights", "weights", 4 * part, "4 B/param, page-locked in place"),
            Component("fp32 gradients", "gradients", 4 * part,
                      "4 B/param, page-locked in place; also holds the 16-bit sums between micro-batches"),
            Component("Adam m and v", "optimizer", 8 * part, "8 B/param, DeepSpeedCPUAdam states"),
            Component("16-bit weight staging" if w == 2 else "weight staging", "buffers",
                      w * min(part, GROUP_ELEMENTS) + w * s.largest_param,
                      "one parameter group's, shared by all groups + largest-param grad buffer"),
            Component("process baseline", "overhead", baseline, "python, torch, CUDA, DeepSpeed"),
        ]
    pin = _pow2 if st.pin_memory else (lambda x: x)
    pinned = " pinned" if st.pin_memory else ""
    master, grads, staging = 4 * part, 4 * part, w * part
    acc = sum(w * numel for numel in s.param_numels) // n if st.accumulation > 1 else 0
    cpu_temp = w * s.largest_param
    comps = [
        Component("fp32 master weights", "weights", master, f"4 B/param{pinned} (line 560)"),
        Component("fp32 gradients", "gradients", grads, f"4 B/param{pinned} (line 937)"),
        Component("Adam m and v", "optimizer", 8 * part, "8 B/param, DeepSpeedCPUAdam states"),
        Component("16-bit weight staging" if w == 2 else "weight staging", "buffers", staging + cpu_temp,
                  f"{w} B/param{pinned} (line 567) + largest-param grad buffer (line 653)"),
    ]
    if acc:
        comps.append(Component("accumulated grads", "buffers", acc,
                               f"{w} B/param{pinned}, gradient accumulation {st.accumulation} (line 1824)"))
    spare = grads if st.delayed_update else 0
    if spare:
        comps.append(Component("delayed-update gradients", "gradients", spare,
                               f"4 B/param{pinned}: the next step's gradients land beside the ones being applied"))
    if st.pin_memory:
        exact = master + grads + staging + cpu_temp + spare
        rounded = pin(master) + pin(grads) + pin(staging) + pin(cpu_temp) + (pin(spare) if spare else 0)
        if acc:
            exact += acc
            rounded += sum(pin(w * numel) for numel in s.param_numels) // n
        comps.append(Component("pinned rounding", "overhead", rounded - exact,
                               "PyTorch rounds pinned blocks up to a power of two"))
    comps.append(Component("process baseline", "overhead", baseline, "python, torch, CUDA, DeepSpeed"))
    return comps


def _largest_batch(fits: Callable[[int], bool], start: int) -> int:
    """Largest b >= 0 with fits(b), for fits monotone decreasing in b."""
    if not fits(1):
        return 0
    lo, hi = 1, max(2, start)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _deepspeed_estimate(n_params: int, gpus: int, offload: bool) -> dict[str, int] | None:
    """DeepSpeed's own numbers (the arithmetic behind estimate_zero2_model_states_mem_needs_all_live)."""
    if not memory.cuda_ready():  # DeepSpeed falls back to its CPU accelerator itself, warning that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        # DeepSpeed's logger writes to stdout from import on; keep `fitone plan --json` one JSON object
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:  # an optional comparison; never the reason a plan fails
        return None
    host, gpu = estimate_zero2_model_states_mem_needs(n_params, num_gpus_per_node=gpus, num_nodes=1,
                                                      cpu_offload=offload)
    return {"gpu": int(gpu), "host": int(host)}
