"""Predict GPU and host memory of a ZeRO-2 run (with or without CPU offload) before allocating anything.

The model is built on the meta device (shapes, no weights). Model states follow what DeepSpeed 0.19's
`deepspeed/runtime/zero/stage_1_and_2.py` allocates (line numbers cited below); activations follow
what autograd saves, counted tensor by tensor for T5, GPT-2 and Llama-style models with a
`saved_tensors_hooks` census on an H200 (torch 2.11, fp16), and checked against ANCHORS.md:
t5-3b fp16, 128/128, checkpointing on, measured 6.7 / 9.3 / 12.3 / 18.3 GiB peak at micro-batch
8 / 64 / 128 / 256 and 16.7 GiB at 8 without checkpointing; host RSS 63.4 GiB.

`plan()` answers "will it fit, and how big a micro-batch"; `preflight()` is the check (host RAM, and the
GPU at micro-batch 1) that `fitone train` and `fitone probe-batch` run from the config before allocating.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fitone import memory
from fitone.memory import GIB
from fitone.config import TrainConfig, parse_size, resolve_precision
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.zero2 import step_mode
from fitone.zero2.step_mode import StepMode


FITS_ON_GPU = "fits without offload"
FITS_WITH_OFFLOAD = "fits with ZeRO-2 CPU offload"
DOES_NOT_FIT = "does not fit"

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")

CUDA_CONTEXT = GIB // 2  # the CUDA context and kernels live outside the allocator (and outside any cap)
FRAGMENTATION = 0.05  # the caching allocator reserves a little more than it hands out
# What the process holds before any model state: python + torch + transformers + DeepSpeed (+ CUDA libs).
# CPU: 0.4 GiB measured here for the imports. GPU box: 1.2 GiB measured on the H200 after CUDA init;
# ANCHORS' t5-3b run settled at 63.4 GiB RSS = 61.25 GiB of states below + ~2 GiB.
BASELINE_GPU_BOX = 2 * GIB
BASELINE_CPU = GIB // 2
# Backward of a recomputed layer holds about three quarters of one FF-sized gradient on top of the
# layer's saved tensors (fitted to the checkpointed t5-3b runs at 128/128 and 256/64, within 2%).
BACKWARD_TRANSIENT_FF = 0.75

# ff-sized tensors an activation function saves for its backward (HF's ACT2FN implementations).
_ACT_SAVED = {"relu": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "quick_gelu": 2,
              "gelu_new": 4, "gelu_fast": 5}
_SAVES_OUTPUT = {"relu"}  # relu keeps its output, which the next op would have kept anyway
_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}


# -- the model's shape ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the formulas need: sizes from the config, parameter counts from the meta model."""

    family: str  # "t5", "gpt2", "llama" or "generic"
    model_type: str
    encoder_decoder: bool
    n_params: int
    largest_param: int  # elements of the biggest single tensor (DeepSpeed sizes staging buffers by it)
    param_numels: tuple[int, ...]
    hidden: int
    layers: int
    decoder_layers: int
    heads: int
    kv_heads: int
    inner: int  # heads x head dim (T5's d_kv can differ from hidden / heads)
    ff: int
    vocab: int
    act: str
    gated: bool
    dropout: bool


def _first(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_shape(cfg: TrainConfig, config: Any = None) -> tuple[ModelShape, list[str]]:
    """Build the model on the meta device and read its sizes. Returns the shape and notes for the user.
    `config`: the model config a caller (training) already loaded; else it is loaded here."""
    from fitone.models import require_model

    require_model(cfg.model)
    key = (cfg.model, cfg.from_scratch, config is not None)
    if key not in _SHAPES:  # building even a meta model takes a second; a plan asks often
        if len(_SHAPES) >= 16:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = _model_shape(cfg.model, cfg.from_scratch, config)
    shape, notes = _SHAPES[key]
    return shape, list(notes)


_SHAPES: dict[tuple[str, bool, bool], tuple[ModelShape, tuple[str, ...]]] = {}


def _model_shape(name: str, from_scratch: bool, config: Any = None) -> tuple[ModelShape, tuple[str, ...]]:
    from fitone.models import build_model, load_config, shipped_models

    notes: list[str] = []
    if config is None and not from_scratch and name in shipped_models() and not Path(name).exists():
        # planning needs the architecture, not the weights: the shipped config is the same model
        config = load_config(name, from_scratch=True)
        notes.append(f"{name}: planned from fitone's shipped config (no weights needed)")
    elif config is None:
        config = load_config(name, from_scratch=from_scratch)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # shapes only: initialising billions of meta weights still costs seconds of CPU
        model = build_model(config, meta=True)
    numels = tuple(p.numel() for p in model.parameters())  # parameters() yields tied weights once

    mtype = getattr(config, "model_type", "") or ""
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    hidden = int(_first(config, ("d_model", "hidden_size", "n_embd")))
    heads = int(_first(config, ("num_heads", "num_attention_heads", "n_head"), max(1, hidden // 64)))
    head_dim = int(_first(config, ("d_kv", "head_dim"), hidden // heads))
    layers = int(_first(config, ("num_layers", "num_hidden_layers", "n_layer", "encoder_layers")))
    family = ("t5" if mtype in ("t5", "mt5") else "gpt2" if mtype == "gpt2" else "llama" if mtype in _LLAMA_LIKE
              else "generic")
    act = str(_first(config, ("dense_act_fn", "hidden_act", "activation_function"), "gelu"))
    dropout = any(float(_first(config, (n,), 0.0) or 0.0) > 0 for n in
                  ("dropout_rate", "resid_pdrop", "hidden_dropout", "dropout", "hidden_dropout_prob"))
    shape = ModelShape(
        family=family,
        model_type=mtype or "unknown",
        encoder_decoder=enc_dec,
        n_params=sum(numels),
        largest_param=max(numels),
        param_numels=numels,
        hidden=hidden,
        layers=layers,
        decoder_layers=int(_first(config, ("num_decoder_layers", "decoder_layers"), layers)) if enc_dec else 0,
        heads=heads,
        kv_heads=int(_first(config, ("num_key_value_heads",), heads)),
        inner=heads * head_dim,
        ff=int(_first(config, ("d_ff", "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim"), 4 * hidden)),
        vocab=int(config.vocab_size),
        act=act,
        gated=bool(getattr(config, "is_gated_act", False)) or family == "llama",
        dropout=dropout,
    )
    if family == "generic":
        notes.append(f"no activation formula for model_type {shape.model_type!r}: used a generic one from hidden "
                     "size, layers and heads (GPT-2-like layers); expect activations within about ±30%")
    return shape, tuple(notes)


# -- activations, bytes per sample ------------------------------------------------------------------
@dataclass(frozen=True)
class Lengths:
    src: int  # encoder tokens (seq2seq) or the sequence (causal)
    tgt: int  # decoder tokens (seq2seq); equal to src for causal models


def _ff_saved(s: ModelShape, a: int, mlp_dropout: bool) -> float:
    """Bytes per token the feed-forward keeps: activation, gate product, dropout mask and output."""
    act_saved = _ACT_SAVED.get(s.act, 1)
    out_kept = s.act in _SAVES_OUTPUT and not s.gated and not mlp_dropout
    total = act_saved * a * s.ff
    if s.gated:
        total += 2 * a * s.ff  # the mul keeps act(gate) and up
    if mlp_dropout:
        total += s.ff + a * s.ff  # bool mask + the dropped output the down projection keeps
    elif not out_kept:
        total += a * s.ff  # the down projection keeps its input
    return total


def _t5_layers(s: ModelShape, a: int, fp16: bool, lengths: Lengths) -> tuple[float, float, float, float]:
    """(encoder layer, decoder layer, encoder head, decoder head) in bytes per token, for T5.

    T5's learned position bias needs a gradient, so SDPA runs its math kernel for self-attention:
    q, k, v upcast to fp32 and fp32 scores (softmax, dropout mask, dropped scores) are kept. Cross-attention
    has no learned bias and keeps only q, k, v, out (a fused kernel). LayerNorm keeps an fp32 copy of its
    input; in fp16 every sublayer clamps (keeping its input).
    """
    d, inner, h = s.hidden, s.inner, s.heads
    drop = 1 if s.dropout else 0
    f32 = 4 * d if a < 4 else 0
    clamp = a * d if fp16 else 0
    norm = a * d + f32 + 2 * a * d  # input, fp32 copy, rescaled, weighted
    r = lengths.src / lengths.tgt

    def self_attn(keys: int) -> float:
        return norm + 12 * inner + (4 + 5 * drop) * h * keys + a * inner + drop * d + clamp

    cross = norm + a * inner + 2 * a * inner * r + a * inner + 4 * h + drop * d + clamp
    ff = norm + _ff_saved(s, a, mlp_dropout=bool(drop)) + drop * d + clamp
    enc = self_attn(lengths.src) + ff
    dec = self_attn(lengths.tgt) + cross + ff
    head = 2 * drop * d + f32 + 3 * a * d  # embedding dropout, final norm, final dropout
    return enc, dec, head, head + a * d  # the decoder's final output also feeds the LM head


def _decoder_layer(s: ModelShape, a: int) -> tuple[float, float]:
    """(layer, head without the loss) in bytes per token, for GPT-2, Llama-style and generic decoders."""
    d, h = s.hidden, s.heads
    drop = 1 if s.dropout else 0
    if s.family == "llama":
        norm = 2 * a * d + 4 * d  # fp32 copy of the input, rescaled, weighted
        kv = 2 * a * d * s.kv_heads / s.heads
        layer = 2 * norm + a * d + kv + a * d + 4 * h + _ff_saved(s, a, mlp_dropout=False)
        return layer, norm
    # GPT-2 (and generic): LayerNorm input + output, fused qkv, q/v/out copies the fused kernel wants,
    # residual dropout masks, MLP
    layer = 10 * a * d + 2 * drop * d + 16 + 4 * h + _ff_saved(s, a, mlp_dropout=False)
    return layer, drop * d + 2 * a * d + 8


def activation_bytes(s: ModelShape, *, precision: str, checkpointing: bool, lengths: Lengths) -> int:
    """Peak activation bytes of one sample in forward + backward (the micro-batch scales it linearly).

    The peak is the larger of two moments: the loss backward (everything kept + the logits' gradients)
    and, with checkpointing, the backward of a recomputed layer (the forward never gets higher). Logits
    are not kept past the loss (fitone keeps only `.loss`). Causal LMs upcast logits to fp32 for the loss
    (transformers' ForCausalLMLoss); T5 computes it in the model's dtype.
    """
    a = 4 if precision == "fp32" else 2
    fp16 = precision == "fp16"
    if s.family == "t5" or s.encoder_decoder:
        if s.family == "t5":
            enc, dec, head_e, head_d = _t5_layers(s, a, fp16, lengths)
        else:  # generic encoder-decoder: decoder-style layers plus a cross-attention on the decoder side
            enc, head_e = _decoder_layer(s, a)
            dec = enc + 6 * a * s.hidden + 2 * a * s.hidden * lengths.src / lengths.tgt + 4 * s.heads
            head_d = head_e + a * s.hidden
        loss_dtype = a
        src, tgt = lengths.src, lengths.tgt
        l_enc, l_dec = s.layers, s.decoder_layers
    else:
        dec, head_d = _decoder_layer(s, a)
        enc, head_e, src, l_enc = 0.0, 0.0, 0, 0
        loss_dtype, tgt, l_dec = 4, lengths.tgt, s.layers
    lsm = loss_dtype * s.vocab * tgt  # log-softmax output kept for the loss backward
    loss_grads = 2 * loss_dtype * s.vocab * tgt  # its incoming gradient and the logits' gradient
    transient = BACKWARD_TRANSIENT_FF * a * s.ff

    if not checkpointing:
        kept = (l_enc * enc + head_e) * src + (l_dec * dec + head_d) * tgt + lsm
        return int(kept + loss_grads)
    # with checkpointing each layer keeps only its input until backward recomputes it
    kept_enc = (l_enc * a * s.hidden + head_e) * src
    kept_dec = (l_dec * a * s.hidden + head_d) * tgt
    loss_phase = kept_enc + kept_dec + lsm + loss_grads
    dec_phase = kept_enc + kept_dec - a * s.hidden * tgt + (dec + transient) * tgt
    enc_phase = kept_enc + a * s.hidden * src + (enc + transient) * src if l_enc else 0.0
    return int(max(loss_phase, dec_phase, enc_phase))


# -- the plan ---------------------------------------------------------------------------------------
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


# -- public API ----------------------------------------------------------------------------------------
def plan(
    cfg: TrainConfig | None = None,
    *,
    gpu_mem: int | str | None = None,
    gpus: int = 1,
    host_mem: int | str | None = None,
    **overrides: Any,
) -> Plan:
    """Predict GPU and host memory for `cfg` (or `TrainConfig(**overrides)`) without allocating the model.

    gpu_mem: the card to plan for ('24GiB'); default this machine's GPU. --max-gpu-memory, when set,
    caps it. Without either and without a GPU, raises ConfigError. host_mem: host RAM to plan for;
    default what is available now. gpus: data-parallel ranks (ZeRO-2 partitions optimizer states).
    """
    cfg = TrainConfig.with_overrides(cfg, overrides)
    limit, source = _gpu_limit(cfg, gpu_mem)
    if limit is None:
        raise ConfigError("no GPU on this machine to plan for: pass --gpu-mem SIZE, the memory of the card "
                          "you will train on (e.g. --gpu-mem 24GiB)")
    return _make_plan(cfg, gpus=gpus, gpu_limit=limit, gpu_limit_source=source,
                      host_available=_host_available(host_mem), on_gpu=cfg.device != "cpu")


def preflight(cfg: TrainConfig, *, micro_batch: int, world_size: int = 1, config: Any = None,
              mode: StepMode | None = None) -> Plan:
    """The refusals the plan can make from the config alone, run before any weights, probe or engine
    exist: raise MemoryBudgetError (one line, exit 2) when host RAM cannot hold the run, or when the GPU
    cannot hold it even at micro-batch 1 (weights, states, buffers; the plan's verdict at size 1),
    instead of the kernel's OOM killer or a CUDA OOM inside DeepSpeed minutes later.
    `config` and `mode`: the model config and step a run already loaded and decided (else done here)."""
    on_gpu = _runs_on_gpu(cfg)
    p = _preflight_plan(cfg, micro_batch, world_size, on_gpu, config, mode)
    need = _host_need(p, on_gpu)
    if need > p.host_available:
        fixes = ["a machine with more host RAM"]
        if p.offload and p.gpu_limit is not None and p.gpu_total_without_offload <= p.gpu_limit:
            fixes.append("--offload none (the GPU can hold the optimizer states)")
        pinned = sum(c.bytes for c in p.host if c.name == "pinned rounding")
        if pinned > 0.05 * need:
            fixes.append(f"\"pin_memory\": false under offload_optimizer in --ds-config (saves {_g(pinned):.1f} GiB)")
        fixes.append("a smaller model")
        raise MemoryBudgetError(
            f"host RAM too small: this run needs {_g(need):.1f} GiB ({_g(p.host_states):.1f} GiB of offloaded "
            f"states per rank + baseline"
            f"{'' if on_gpu else ' + the model, buckets and activations a CPU run keeps there'}"
            f") but {_g(p.host_available):.1f} GiB is available, {_g(need - p.host_available):.1f} GiB short; "
            f"use {', or '.join(fixes)}"
        )
    if p.gpu_limit is not None:
        # the plan's verdict at the smallest micro-batch: whatever it counts (weights, buckets, optimizer
        # states, init peak) must fit before a probe or the user's batch size can matter
        at_one = p if micro_batch == 1 else _preflight_plan(cfg, 1, world_size, on_gpu, config, mode)
        if "GPU" in at_one.short:
            fixes = []
            if not at_one.offload and at_one.verdict == FITS_WITH_OFFLOAD:
                fixes.append("--offload cpu (the optimizer states move to host RAM)")
            if not at_one.activation_checkpointing:
                fixes.append("--activation-checkpointing")
            if cfg.max_gpu_memory:
                fixes.append("a larger --max-gpu-memory")
            fixes += ["a GPU with more memory", "a smaller model"]
            raise MemoryBudgetError(
                f"does not fit on the GPU even at micro-batch 1: the plan needs {_g(at_one.gpu_total):.1f} GiB "
                f"({_g(at_one.by_category('gpu')['weights']):.1f} GiB of weights) of {_g(at_one.gpu_limit):.1f} GiB "
                f"({at_one.gpu_limit_source}), {_g(at_one.short['GPU']):.1f} GiB short; use {', or '.join(fixes)} "
                "(`fitone plan` shows where the memory goes; --no-preflight tries anyway)"
            )
    return p


def host_micro_batch_bound(cfg: TrainConfig, *, config: Any = None, mode: StepMode | None = None) -> int:
    """The largest micro-batch whose run the plan fits in available host RAM (0: not even 1). On a CPU,
    where nothing runs out of memory the way a GPU does, this is what bounds a batch-size search."""
    on_gpu = _runs_on_gpu(cfg)
    one_step = cfg.replace(global_batch=None, grad_accum=None)  # as a probe runs: every step an optimizer step
    one_gpu = mode.on_one_gpu() if mode is not None else None
    return _largest_batch(
        lambda b: _host_need(p := _preflight_plan(one_step, b, 1, on_gpu, config, one_gpu), on_gpu) <= p.host_available,
        64)


def _runs_on_gpu(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and memory.cuda_ready())


def _preflight_plan(cfg: TrainConfig, micro_batch: int, world_size: int, on_gpu: bool, config: Any = None,
                    mode: StepMode | None = None) -> Plan:
    limit, source = _gpu_limit(cfg, None) if on_gpu else (None, "no GPU: not checked")
    return _make_plan(cfg.replace(batch_size=micro_batch), gpus=world_size, gpu_limit=limit,
                      gpu_limit_source=source or "", host_available=_host_available(None), on_gpu=on_gpu,
                      config=config, mode=mode)


def _host_need(p: Plan, on_gpu: bool) -> int:
    # on a CPU run the "GPU" side (weights, buckets, activations) lives in host RAM too
    return p.host_total + (0 if on_gpu else p.gpus * p.gpu_allocated)


# what to change when memory runs out in a phase the pre-flight passed (it did not foresee the failure)
PHASE_FIXES = {
    "model build": "the weights did not fit where they were built (host RAM for training, the GPU for a probe): "
                   "free memory there, use a machine with more, or a smaller model",
    "engine init": "DeepSpeed could not place the weights, gradient buckets and optimizer states before the first "
                   "step: use --offload cpu (if it is off), a larger --max-gpu-memory, a smaller reduce_bucket_size "
                   "in a --ds-config file, a GPU with more memory, or a smaller model; `fitone plan` shows where "
                   "the memory goes",
}


@contextlib.contextmanager
def unforeseen_oom(phase: str, *, verbose: bool = False) -> Iterator[None]:
    """Turn an out-of-memory error in `phase` (a key of PHASE_FIXES) that the pre-flight did not foresee
    into one line naming the phase and the fix (MemoryBudgetError, exit 2); with `verbose` the CLI also
    prints the traceback."""
    try:
        yield
    except Exception as exc:
        if not memory.is_oom_error(exc):
            raise
        err = MemoryBudgetError(f"out of memory in the {phase}, which the plan did not foresee: {PHASE_FIXES[phase]}"
                                f"{'' if verbose else ' (--verbose shows the traceback)'}")
        err.show_traceback = verbose
        raise err from exc


def _gpu_limit(cfg: TrainConfig, gpu_mem: int | str | None) -> tuple[int | None, str]:
    """Card-equivalent bytes gpu_total must stay under, and where that number came from."""
    card = parse_size(gpu_mem, "--gpu-mem")
    source = f"--gpu-mem {gpu_mem}" if card else ""
    if card is None and memory.cuda_ready():
        total, free = memory.gpu_total_bytes(), memory.gpu_free_bytes()
        card = min(total, free + CUDA_CONTEXT)  # our own context is already out of `free`
        source = f"this machine's {memory.gpu_name()}"
    cap = cfg.max_gpu_memory_bytes
    if cap is not None and (card is None or cap + CUDA_CONTEXT < card):
        return cap + CUDA_CONTEXT, f"--max-gpu-memory {cfg.max_gpu_memory} + CUDA context"
    return card, source


def _host_available(host_mem: int | str | None) -> int:
    # this process's own memory comes back when `fitone plan` exits, and in train it is the baseline
    return parse_size(host_mem, "--host-mem") or memory.host_available_bytes() + memory.host_rss_bytes()


def _make_plan(cfg: TrainConfig, *, gpus: int, gpu_limit: int | None, gpu_limit_source: str,
               host_available: int, on_gpu: bool, config: Any = None, mode: StepMode | None = None) -> Plan:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus must be a positive whole number, got {gpus!r}")
    cfg = cfg.replace(precision=resolve_precision(cfg.precision, on_gpu))  # an 'auto' precision, as training picks it
    shape, notes = model_shape(cfg, config)
    lengths = Lengths(cfg.src_len, cfg.tgt_len) if shape.encoder_decoder else Lengths(cfg.seq_len, cfg.seq_len)
    if cfg.pack and shape.encoder_decoder:
        raise ConfigError(f"--pack is for causal LMs; {cfg.model} is seq2seq: drop --pack")
    if cfg.pack:  # the lengths above are the worst case of padded batches, and every packed batch's
        notes = [*notes, f"--pack: every batch is full ({cfg.seq_len} tokens per row), so every step takes this memory"]
    auto = cfg.batch_size == "auto"
    from fitone.ds_config import build_ds_config

    ds = build_ds_config(cfg, micro_batch=1 if auto else int(cfg.batch_size), world_size=gpus, on_gpu=on_gpu)
    zero = ds.get("zero_optimization", {})
    offload_cfg = zero.get("offload_optimizer") or {}
    offload = offload_cfg.get("device") == "cpu"
    st = _Setup(shape=shape, precision=cfg.precision, checkpointing=cfg.activation_checkpointing, lengths=lengths,
                gpus=gpus, accumulation=int(ds.get("gradient_accumulation_steps", 1)),
                bucket=int(float(zero.get("reduce_bucket_size", 5e8))), overlap_comm=bool(zero.get("overlap_comm")),
                pin_memory=bool(offload_cfg.get("pin_memory", False)), on_gpu=on_gpu,
                delayed_update=cfg.delayed_update,
                pipelined_update=(mode or step_mode.for_config(cfg, world_size=gpus, on_gpu=on_gpu, ds=ds)).name
                == step_mode.PIPELINED)

    def gpu_total(b: int, off: bool, setup: _Setup = st) -> int:
        return sum(c.bytes for c in _gpu_components(setup, off, b))

    def max_batch(off: bool, setup: _Setup = st) -> int | None:
        if gpu_limit is None:
            return None
        return _largest_batch(lambda b: gpu_total(b, off, setup) <= gpu_limit, 64)

    best = max_batch(offload)
    micro_batch = max(1, best or 1) if auto else int(cfg.batch_size)
    host = _host_components(st, offload)
    host_total = gpus * sum(c.bytes for c in host)
    host_no = gpus * sum(c.bytes for c in _host_components(st, False))
    gpu = _gpu_components(st, offload, micro_batch)
    p = Plan(
        model=cfg.model or "", family=shape.family, n_params=shape.n_params, precision=cfg.precision,
        offload=offload, gpus=gpus, micro_batch=micro_batch,
        lengths={"src_len": lengths.src, "tgt_len": lengths.tgt} if shape.encoder_decoder else {"seq_len": lengths.src},
        activation_checkpointing=cfg.activation_checkpointing, gpu=gpu, host=host,
        gpu_total=sum(c.bytes for c in gpu), host_total=host_total, gpu_limit=gpu_limit,
        gpu_limit_source=gpu_limit_source, host_available=host_available,
        activation_per_sample=st.per_sample(), activation_per_sample_ckpt=st.per_sample(True),
        activation_per_sample_no_ckpt=st.per_sample(False), max_micro_batch=best,
        max_micro_batch_without_offload=max_batch(False), gpu_total_without_offload=gpu_total(micro_batch, False),
        host_total_without_offload=host_no, verdict=DOES_NOT_FIT, notes=notes,
        deepspeed_estimate=_deepspeed_estimate(shape.n_params, gpus, offload),
    )
    # an 'auto' micro-batch is probed later: it fits if a micro-batch of 1 does
    _judge(p, st, gpu_total, max_batch, judge_at=1 if auto else micro_batch)
    return p


def _judge(p: Plan, st: _Setup, gpu_total: Callable[..., int], max_batch: Callable[..., int | None],
           judge_at: int) -> None:
    """Fill in the verdict, what runs short, and what would help."""
    gpu_ok = lambda total: p.gpu_limit is None or total <= p.gpu_limit  # noqa: E731
    host_ok = lambda total: total <= p.host_available  # noqa: E731
    gpu_off, gpu_on = gpu_total(judge_at, True), gpu_total(judge_at, False)
    host_off = p.host_total if p.offload else st.gpus * sum(c.bytes for c in _host_components(st, True))
    if p.gpu_limit is not None and gpu_ok(gpu_on) and host_ok(p.host_total_without_offload):
        p.verdict = FITS_ON_GPU
    elif gpu_ok(gpu_off) and host_ok(host_off):
        p.verdict = FITS_WITH_OFFLOAD
    else:
        p.verdict = DOES_NOT_FIT
    # shortfalls of the configured mode
    if p.gpu_limit is not None and p.gpu_total > p.gpu_limit:
        p.short["GPU"] = p.gpu_total - p.gpu_limit
    if p.host_total > p.host_available:
        p.short["host"] = p.host_total - p.host_available

    tips = p.suggestions
    if p.verdict == FITS_ON_GPU and p.offload:
        tips.append("--offload none: everything fits on the GPU, and ZeRO-2 without offload is about 2x faster "
                    "(no CPU Adam step)")
    if p.verdict == FITS_WITH_OFFLOAD and not p.offload:
        tips.append(f"--offload cpu: the optimizer states move to host RAM, saving "
                    f"{_g(gpu_on - gpu_off):.1f} GiB of GPU memory")
    if "GPU" in p.short:
        if p.max_micro_batch:
            tips.append(f"--batch-size {p.max_micro_batch} (the largest that fits; add --grad-accum to keep the "
                        "global batch)")
        alternatives = [
            ("--precision bf16 (or fp16): 16-bit weights and activations", p.precision == "fp32",
             dataclasses.replace(st, precision="bf16")),
            ("--activation-checkpointing: recompute activations in backward", not st.checkpointing,
             dataclasses.replace(st, checkpointing=True)),
            ("half the lengths (--src-len/--tgt-len or --seq-len)", True,
             dataclasses.replace(st, lengths=Lengths(max(1, st.lengths.src // 2), max(1, st.lengths.tgt // 2)))),
            ("reduce_bucket_size 5e7 in a --ds-config file (smaller gradient buckets)", st.bucket > 5e7,
             dataclasses.replace(st, bucket=int(5e7))),
        ]
        for text, applies, alt in alternatives:
            if applies:
                saved = gpu_total(p.micro_batch, p.offload) - gpu_total(p.micro_batch, p.offload, alt)
                tips.append(f"{text}: saves {_g(saved):.1f} GiB at this micro-batch, largest micro-batch "
                            f"{max_batch(p.offload, alt)}")
    if "host" in p.short:
        tips.append(f"a machine with at least {_g(p.host_total) + 1:.0f} GiB of host RAM "
                    f"({_g(p.short['host']):.1f} GiB more than available)")
        pinned = sum(c.bytes for c in p.host if c.name == "pinned rounding")
        if pinned:
            tips.append(f"\"pin_memory\": false under offload_optimizer in a --ds-config file: saves "
                        f"{_g(pinned * st.gpus):.1f} GiB of power-of-two rounding, at some transfer speed")
        if p.offload and p.gpu_limit is not None and gpu_ok(gpu_on):
            tips.append("--offload none: the GPU can hold the optimizer states")
        tips.append("a smaller model")

