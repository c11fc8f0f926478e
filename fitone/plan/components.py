"""What each piece of a ZeRO-2 run holds on the GPU and in host RAM, in bytes: the component arithmetic.

Model states follow what DeepSpeed 0.19's `deepspeed/runtime/zero/stage_1_and_2.py` allocates (its line
numbers are cited in comments; the rows a user reads name what each piece is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from fitone import memory, zero2
from fitone.plan.activations import Lengths, activation_bytes, activation_moments, fused_loss_fixed_bytes
from fitone.plan.result import Component
from fitone.plan.shape import ModelShape
from fitone.units import GIB
from fitone.zero2 import gpu_adam, layout, low_precision, overlap, speculative, upload

CUDA_CONTEXT = GIB // 2  # the CUDA context and kernels live outside the allocator (and outside any cap)
# What the caching allocator reserves beyond what it hands out, with expandable segments (the default). Two probes
# under a 23 GiB cap bound it from either side: Qwen2.5-7B fit micro-batch 29 at 22.3 GiB allocated and not 30
# (~22.5 GiB), so over 2.0% (bench/results/2026-12-02-gpu/qwen2.5-7b/); Llama-3.1-8B fit 26 at 22.63 GiB, so at
# most 1.6% there (bench/results/2026-12-02c-gpu/call2/). 2% keeps each probe's largest within one of the plan's.
FRAGMENTATION = 0.02
# What the process holds before any model state (python, torch, transformers, DeepSpeed, CUDA libs),
# calibrated against measured runs (tests/plan/test_plan.py names the calibration; bench/results/ the runs).
BASELINE_GPU_BOX = 2 * GIB
BASELINE_CPU = GIB // 2


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
    pipelined_update: bool = False  # two upload chunks, on the GPU or the host (fitone.zero2.upload)
    fused_loss: str | None = None  # causal LMs: the fused LM head + loss's backend (fitone.loss), None: the model's
    optimizer_states: str = "fp32"  # bf16 ones: bf16 master and moments on the lean layout (fitone.zero2.low_precision)
    speculative_update: bool = False  # a chunk's scratch for undoing its early Adam (fitone.zero2.speculative)
    gpu_share: float = 0.0  # the GPU's share of the Adam: its pieces' buffers (fitone.zero2.gpu_adam)

    @property
    def w(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def master(self) -> int:
        """Bytes per element of the master weights (and of each Adam moment) on the host."""
        return 4 if self.optimizer_states == "fp32" else 2

    def per_sample(self, checkpointing: bool | None = None) -> int:
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        return activation_bytes(self.shape, precision=self.precision, checkpointing=ckpt, lengths=self.lengths,
                                fused_loss=self.fused_loss)

    def moments(self) -> dict[str, int]:
        """Activation bytes of one sample at the loss's backward and at a recomputed layer's (activation_moments)."""
        return activation_moments(self.shape, precision=self.precision, checkpointing=self.checkpointing,
                                  lengths=self.lengths, fused_loss=self.fused_loss)


def _gpu_components(st: _Setup, offload: bool, micro_batch: int) -> list[Component]:
    s, w, n = st.shape, st.w, st.gpus
    part = math.ceil(s.n_params / n)
    bits = "fp32" if w == 4 else "16-bit"
    comps = [Component("weights", "weights", w * s.n_params, f"{bits}, {w} B/param")]  # bit16_groups_flat, line 505
    largest = s.largest_param
    if offload and not st.pipelined_update:  # the lean layout's staging is the layers' moment's (_moment_components)
        upcast = 4 * largest if w < 4 else 0
        # temp_grad_buffer_for_gpu_offload (line 659), the autograd grad, the fp32 copy for the CPU (line 1898)
        comps.append(Component("offload staging", "buffers", 2 * w * largest + upcast,
                               "largest param: the gradient offload buffer, its autograd grad"
                               + (", an fp32 copy for the CPU" if upcast else "")))
    if offload:
        if st.pipelined_update and st.on_gpu:
            landing = upload.buffer_bytes(min(overlap.UPLOAD_CHUNK, part), st.master, w)[0]
            kind = "fp32" if st.master == 4 else "bf16"
            if landing:  # none where the cast is made on the host (its chunks are there)
                comps.append(Component("pipelined-update landing", "buffers", landing,
                                       f"two {kind} chunks: the updated master goes up and is cast on the GPU"))
            if st.gpu_share:
                comps.append(Component("GPU Adam share", "buffers", gpu_adam.gpu_bytes(),
                                       f"{gpu_adam.SETS} pieces of fp32 master and moments and 16-bit gradients, "
                                       "stepped on the GPU"))
            if n > 1:  # torch's NCCL all_gather into a list of tensors gathers into one flat tensor first
                comps.append(Component("pipelined-update gather", "buffers", n * w * min(overlap.UPLOAD_CHUNK, part),
                                       f"one chunk of each of the {n} ranks' partitions, as it is all-gathered"))
    else:
        comps.append(Component("gradient partition", "gradients", w * part,
                               f"{bits} grads of this rank's partition"))  # grads_in_partition, line 2192
        comps.append(Component("optimizer states", "optimizer", 12 * part,
                               "fp32 master + Adam m, v, on the GPU"))  # fp32 master: line 560
        comps.append(Component("largest grad", "buffers", w * largest, "autograd's grad before the bucket copy"))
    comps += _moment_components(st, offload, micro_batch)
    if not offload:  # step: fp32 grads of the partition exist once activations are gone (flatten in step())
        backward = sum(c.bytes for c in comps)
        step = backward - sum(c.bytes for c in comps if c.category == "activations") + 4 * part
        if step > backward:
            comps.append(Component("step fp32 grads", "buffers", step - backward,
                                   "optimizer step's fp32 grad partition beyond the backward peak"))
    return _with_overhead(st, comps)


def _moment_components(st: _Setup, offload: bool, micro_batch: int) -> list[Component]:
    """The activations and what else is alive at the higher of the backward's two moments (with checkpointing).

    The loss's backward: every layer's kept input and the loss's own tensors; with a fused loss, its chunk of
    logits, the LM head's gradient made there, and the gradient buckets DeepSpeed makes at the first gradient. A
    model's own loss peaks before any parameter has a gradient (a causal LM's in the log-softmax's backward), so
    before the buckets exist. A recomputed layer's backward: its tensors, the buckets and (the lean layout) the
    gradients' way to the host, which runs as the layers make them. Measured:
    Llama-3.1-8B's probe trials bind at the loss's moment below ~16 and at the layers' from 16 up
    (bench/results/2026-12-02c-gpu/call2/, 2026-12-02d-gpu/call2/)."""
    moments = st.moments()
    lean = offload and st.pipelined_update
    nbuf = 2 if st.overlap_comm else 1
    # made at the backward's first gradient and freed at its end (setup_buckets, lines 3256-3280; line 1061)
    how = "overlap_comm" if nbuf == 2 else "one bucket"
    buckets = Component("gradient buckets", "gradients", nbuf * st.bucket * st.w,
                        f"{nbuf} x reduce_bucket_size {st.bucket:.2g} ({how})")
    layer_only = [buckets, _lean_staging(st)] if lean else [buckets]
    fixed = fused_loss_fixed_bytes(st.shape, precision=st.precision, fused_loss=st.fused_loss)
    loss_extra = [Component("fused loss", "activations", fixed,
                            "one chunk of logits in the loss's backward (fitone.loss)")] if fixed else []
    fused = st.shape.fused(st.fused_loss) is not None
    if lean and fused and _over_bucket(st):
        loss_extra.append(Component("LM head gradient", "gradients", st.w * _over_bucket(st) + _norm_chunks(st),
                                    "made in the loss's backward and, over reduce_bucket_size, reduced in place: one "
                                    "chunk of its fp64 copy for the norm and one of its sum on the way to the host"))
    if "layers" not in moments:  # without checkpointing everything is kept until the backward frees it
        return [Component("activations", "activations", moments["loss"] * micro_batch,
                          f"{micro_batch} x {moments['loss'] / 2**20:.1f} MiB"), *layer_only, *loss_extra]
    # the head's gradient, made in a fused loss's backward, has its hook make the buckets there
    loss_only = [buckets, *loss_extra] if fused else loss_extra
    loss = moments["loss"] * micro_batch + sum(c.bytes for c in loss_only)
    layers = moments["layers"] * micro_batch + sum(c.bytes for c in layer_only)
    last = [buckets, *_embedding_moment(st)] if lean else []
    if len(last) > 1 and sum(c.bytes for c in last) > max(loss, layers):
        return last
    if layers >= loss:
        return [Component("activations", "activations", moments["layers"] * micro_batch,
                          f"{micro_batch} x {moments['layers'] / 2**20:.1f} MiB, at a recomputed layer's backward"),
                *layer_only]
    return [Component("activations", "activations", moments["loss"] * micro_batch,
                      f"{micro_batch} x {moments['loss'] / 2**20:.1f} MiB, at the loss's backward"), *loss_only]


def _embedding_moment(st: _Setup) -> list[Component]:
    """What is alive at the last parameter over reduce_bucket_size's gradient hook (the input embedding's, at the
    backward's end), where the layers' activations are gone: its autograd gradient and DeepSpeed's clone of it
    (with offload, line 1446), and, on the micro-batches before the boundary, an untied LM head's gradient held
    since the loss. At the boundary the copy to the host takes the gradient's norm instead (_norm_chunks).
    Measured with torch's memory history: Qwen3-8B at 2 x 3 peaks there, at the same GiB as at 2 x 24
    (bench/results/2026-12-03-gpu/call1/)."""
    over = sorted((n for n in st.shape.param_numels if n > st.bucket), reverse=True)
    if not over:
        return []
    w, last = st.w, over[0]
    boundary = 2 * w * last + _norm_chunks(st)
    held = over[1] if len(over) > 1 and st.accumulation > 1 and not st.shape.tied_embeddings else 0
    before = w * (held + 2 * last + min(last, layout.CHUNK_ELEMENTS)) if st.accumulation > 1 else 0
    return [Component("embedding gradient", "gradients", max(boundary, before),
                      "at the embedding's backward: its autograd grad and DeepSpeed's clone for the host"
                      + (", and the LM head's, held to the backward's end (accumulating)" if held else ""))]


def _lean_staging(st: _Setup) -> Component:
    """The lean layout's (fitone.zero2.layout) GPU buffers on the gradients' way to the host: the largest bucketed
    parameter's autograd gradient, one held to the backward's end where accumulating, one chunk of an fp64 copy
    for a parameter's norm at the boundary and one chunk of its sum so far."""
    held = _held_gradient(st)
    return Component("offload staging", "buffers", st.w * (_in_bucket_largest(st) + held) + _norm_chunks(st),
                     "largest param: its autograd grad" + (", and one held to the backward's end (accumulating)"
                                                           if held else "")
                     + "; one chunk of its fp64 copy for the norm at the boundary and one of its sum so far")


def _norm_chunks(st: _Setup) -> int:
    """Bytes of a gradient's way to the host at the boundary: one chunk of the fp64 copy its norm is taken of and
    one chunk of its sum so far (fitone.zero2.layout)."""
    largest = st.shape.largest_param
    return 8 * min(largest, layout.NORM_CHUNK_ELEMENTS) + st.w * min(largest, layout.CHUNK_ELEMENTS)


def _over_bucket(st: _Setup) -> int:
    """Elements of the largest parameter over reduce_bucket_size (0: none), which DeepSpeed reduces in place."""
    return max((n for n in st.shape.param_numels if n > st.bucket), default=0)


def _in_bucket_largest(st: _Setup) -> int:
    """Elements of the largest parameter DeepSpeed copies into a gradient bucket: autograd's gradient of it lives
    only until that copy (reduce_independent_p_g_buckets_and_remove_grads, lines 1456-1459)."""
    return max((n for n in st.shape.param_numels if n <= st.bucket), default=0)


def _held_gradient(st: _Setup) -> int:
    """Elements of a 16-bit gradient alive at the activation peak beyond the buckets: the largest parameter over
    reduce_bucket_size, where its gradient outlives its reduction.

    Such a parameter is reduced in place, not copied into a bucket (line 1449: extra_large_param_to_reduce).
    At the accumulation boundary its copy to the host clears the gradient at once (copy_grads_in_partition,
    line 2176: fitone.zero2.layout's copy_to_host), before the layers' backward; on the micro-batches before
    the boundary, its copy to the held sum (line 2167) clears nothing, and the backward's epilogue does
    (_clear_param_grad_only, line 1067). An untied LM head comes first in the
    backward, so from the second micro-batch of a step on (accumulation > 1) its gradient is alive through
    the layers' recomputed activations: measured, ~1 GiB more at the same micro-batch for Qwen2.5-7B
    (bench/results/2026-12-02-gpu/qwen2.5-7b/). A tied one sums over the whole backward at any accumulation.
    """
    over = _over_bucket(st)
    return over if st.accumulation > 1 or st.shape.tied_embeddings else 0


def _with_overhead(st: _Setup, comps: list[Component]) -> list[Component]:
    """What the GPU holds beyond the allocated pieces: the CUDA context (on a GPU) and a fragmentation margin."""
    allocated = sum(c.bytes for c in comps)
    if st.on_gpu:
        comps.append(Component("CUDA context", "overhead", CUDA_CONTEXT, "outside the allocator"))
    comps.append(Component("fragmentation margin", "overhead", int(FRAGMENTATION * allocated),
                           f"{FRAGMENTATION * 100:g}% of allocated"))
    return comps


def _gpu_init_components(st: _Setup, offload: bool) -> list[Component]:
    """The GPU at the engine's init, before any activation: DeepSpeed flattens each parameter group into one
    buffer beside the group's own tensors (fitone.zero2.layout bounds the groups), and without offload makes
    the fp32 master there. Measured over the weights: the largest group and about one more bounded group
    (llama-7b, groups of up to 2^27 elements: bench/results/2026-12-01-issue19-export-t5/; Llama-3.1-8B, its
    525M-element embedding alone in a group: bench/results/2026-12-01-issue27/llama-3.1-8b/)."""
    s, w = st.shape, st.w
    part = math.ceil(s.n_params / st.gpus)
    sizes = [0] * (max(layout.group_of_each(list(s.param_numels)), default=0) + 1)
    for n, g in zip(s.param_numels, layout.group_of_each(list(s.param_numels))):
        sizes[g] += n
    pair = max(sizes) + min(layout.GROUP_ELEMENTS, s.n_params - max(sizes))
    comps = [Component("weights", "weights", w * s.n_params, f"{'fp32' if w == 4 else '16-bit'}, {w} B/param"),
             Component("group flattening", "buffers", w * pair,
                       "the largest parameter group's flat copy and about one more group's, beside their "
                       "tensors (flatten_dense_tensors_aligned)")]
    if not offload:
        comps.append(Component("fp32 master", "optimizer", 4 * part, "made on the GPU at init"))  # line 560
    return _with_overhead(st, comps)


def _host_components(st: _Setup, offload: bool) -> list[Component]:
    s, w, n = st.shape, st.w, st.gpus
    part = math.ceil(s.n_params / n)
    baseline = BASELINE_GPU_BOX if st.on_gpu else BASELINE_CPU
    if not offload:
        return [Component("model load", "weights", 4 * s.n_params, "fp32 weights on the CPU before they move"),
                Component("process baseline", "overhead", baseline, "python, torch, CUDA, DeepSpeed")]
    if st.pipelined_update:  # the lean host layout (fitone.zero2.layout): the arithmetic's 14 B/param, little else
        chunks = upload.buffer_bytes(min(overlap.UPLOAD_CHUNK, part), st.master, w)[1] if st.on_gpu else 0
        cast = [Component("pipelined-update upload chunks", "buffers", chunks, "two page-locked 16-bit chunks: Adam "
                          "writes the master's cast there, and it goes up")] if chunks else []
        return _lean_host_components(st, part) + cast + [
            Component("process baseline", "overhead", baseline, "python, torch, CUDA, DeepSpeed")]
    pin = _pow2 if st.pin_memory else (lambda x: x)
    pinned = " pinned" if st.pin_memory else ""
    master, grads, staging = 4 * part, 4 * part, w * part
    acc = sum(w * numel for numel in s.param_numels) // n if st.accumulation > 1 else 0
    cpu_temp = w * s.largest_param
    comps = [  # DeepSpeed's lines: master 560, gradients 937, staging 567, largest-param grad buffer 653
        Component("fp32 master weights", "weights", master, f"4 B/param{pinned}"),
        Component("fp32 gradients", "gradients", grads, f"4 B/param{pinned}"),
        Component("Adam m and v", "optimizer", 8 * part, "8 B/param, DeepSpeedCPUAdam states"),
        Component("16-bit weight staging" if w == 2 else "weight staging", "buffers", staging + cpu_temp,
                  f"{w} B/param{pinned} + largest-param grad buffer"),
    ]
    if acc:
        comps.append(Component("accumulated grads", "buffers", acc,  # line 1824
                               f"{w} B/param{pinned}, gradient accumulation {st.accumulation}"))
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


def _lean_host_components(st: _Setup, part: int) -> list[Component]:
    """The lean layout's host buffers: 14 B/param (16 in fp32 training), 8 with --optimizer-states bf16."""
    w, m = st.w, st.master
    kind = "fp32" if m == 4 else "bf16"
    comps = [
        Component(f"{kind} master weights", "weights", m * part, f"{m} B/param, page-locked in place"),
        Component("gradients", "gradients", w * part,
                  f"{w} B/param in the dtype DeepSpeed sums them in, page-locked in place; also the sums "
                  "between micro-batches"),
        Component("Adam m and v", "optimizer", 2 * m * part,
                  f"{2 * m} B/param, DeepSpeedCPUAdam's states" + ("" if m == 4 else " in bf16")),
    ]
    if w < 4 and m == 4:  # the fused 16-bit step reads the 16-bit gradients as they are
        comps.append(Component("fp32 gradient chunk", "buffers", 4 * min(part, layout.WIDEN_ELEMENTS),
                               "the gradients widened for Adam a slice at a time"))
    if st.speculative_update:  # no copy of the states: an undo inverts Adam on one chunk at a time
        scratch = speculative.UNDO_SCRATCH_BYTES * min(part, layout.CHUNK_ELEMENTS)
        comps.append(Component("speculation undo scratch", "buffers", scratch,
                               "--speculative-update's fp32 gradient and denominator while it undoes a chunk"))
    if st.optimizer_states in low_precision.COMPENSATED:  # bf16-kahan: what rounding the master lost, in bf16
        comps.append(Component("compensation", "optimizer", 2 * part, "2 B/param, bf16-kahan's rounding errors"))
    if m < 4 and low_precision.ROUNDING_OF_STATES[st.optimizer_states] == low_precision.STOCHASTIC:
        comps.append(Component("random bits' table", "buffers", low_precision.host_bytes(low_precision.STOCHASTIC),
                               "stochastic rounding's, read by the fused 16-bit step"))
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


def _deepspeed_estimate(n_params: int, gpus: int, nodes: int, offload: bool) -> dict[str, int] | None:
    """DeepSpeed's own numbers for the model states (fitone.zero2.model_states_estimate), beside the plan's: a
    GPU's and one node's host, for `gpus` ranks on each of `nodes`."""
    return zero2.model_states_estimate(n_params, gpus=gpus, nodes=nodes, offload=offload, on_gpu=memory.cuda_ready())
