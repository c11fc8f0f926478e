"""The verdict, what runs short and what would help: decisions in words, for a Plan to carry (no printing)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Callable

from fitone import memory
from fitone.errors import MemoryBudgetError
from fitone.plan.activations import Lengths
from fitone.plan.components import _host_components, _Setup
from fitone.plan.result import Plan, _g

FITS_ON_GPU = "fits without offload"
FITS_WITH_OFFLOAD = "fits with ZeRO-2 CPU offload"
DOES_NOT_FIT = "does not fit"


# what to change when memory runs out in a phase the pre-flight passed (it did not foresee the failure)
PHASE_FIXES = {
    "model build": "the weights did not fit where they were built (host RAM for a pretrained model, a GPU for a "
                   "from-scratch model or a probe): "
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


def _judge(p: Plan, st: _Setup, gpu_peak: Callable[..., int], max_batch: Callable[..., int | None],
           judge_at: int) -> None:
    """Fill in the verdict, what runs short, and what would help."""
    gpu_off, gpu_on = gpu_peak(judge_at, True), gpu_peak(judge_at, False)
    host_off = p.host_total if p.offload else p.gpus * sum(c.bytes for c in _host_components(st, True))  # a node's
    if p.gpu_limit is not None and _gpu_ok(p, gpu_on) and p.host_total_without_offload <= p.host_available:
        p.verdict = FITS_ON_GPU
    elif _gpu_ok(p, gpu_off) and host_off <= p.host_available:
        p.verdict = FITS_WITH_OFFLOAD
    else:
        p.verdict = DOES_NOT_FIT
    # shortfalls of the configured mode
    if p.gpu_limit is not None and p.gpu_peak > p.gpu_limit:
        p.short["GPU"] = p.gpu_peak - p.gpu_limit
    if p.host_export > p.host_available:  # the run's host peak: the steps' plus the export's one shard
        p.short["host"] = p.host_export - p.host_available

    if p.verdict == FITS_ON_GPU and p.offload:
        # for the host RAM, not for speed: on one GPU the default pipelined offload runs about as fast as no
        # offload (t5-3b on an H200, bench/results/2026-12-01-recipes/)
        p.suggestions.append("--offload none: everything fits on the GPU, and the optimizer states need no host RAM")
    if p.verdict == FITS_WITH_OFFLOAD and not p.offload:
        p.suggestions.append(f"--offload cpu: the optimizer states move to host RAM, saving "
                             f"{_g(gpu_on - gpu_off):.1f} GiB of GPU memory")
    if "GPU" in p.short:
        p.suggestions.extend(_gpu_tips(p, st, gpu_peak, max_batch))
    if "host" in p.short:
        p.suggestions.extend(_host_tips(p, st, gpu_on))


def _gpu_ok(p: Plan, total: int) -> bool:
    return p.gpu_limit is None or total <= p.gpu_limit


def _gpu_tips(p: Plan, st: _Setup, gpu_peak: Callable[..., int], max_batch: Callable[..., int | None]) -> list[str]:
    """What would bring the GPU under its limit, each with what it saves at this micro-batch."""
    tips = []
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
            saved = gpu_peak(p.micro_batch, p.offload) - gpu_peak(p.micro_batch, p.offload, alt)
            if saved > 0:  # nothing a step holds helps when the engine's init is what binds
                tips.append(f"{text}: saves {_g(saved):.1f} GiB at this micro-batch, largest micro-batch "
                            f"{max_batch(p.offload, alt)}")
    if p.gpu_peak_phase == "engine init":
        tips.append("a GPU with more memory, or a smaller model: the engine's init, before any batch, needs "
                    f"{_g(p.gpu_init_total):.1f} GiB")
    return tips


def _host_tips(p: Plan, st: _Setup, gpu_on: int) -> list[str]:
    """What would bring host RAM under what is available."""
    tips = [f"a machine with at least {_g(p.host_export) + 1:.0f} GiB of host RAM "
            f"({_g(p.short['host']):.1f} GiB more than available)"]
    if p.host_export_16bit_states is not None:
        tips.append(sixteen_bit_states_fix(p, p.host_export_16bit_states))
    pinned = sum(c.bytes for c in p.host if c.name == "pinned rounding")
    if pinned:
        tips.append(f"\"pin_memory\": false under offload_optimizer in a --ds-config file: saves "
                    f"{_g(pinned * p.gpus):.1f} GiB of power-of-two rounding, at some transfer speed")
    if p.offload and p.gpu_limit is not None and _gpu_ok(p, gpu_on):
        tips.append("--offload none: the GPU can hold the optimizer states")
    tips.append("a smaller model")
    return tips


def sixteen_bit_states_fix(p: Plan, need: int) -> str:
    """The --optimizer-states bf16 fix, with the host RAM (`need` bytes) the run would take under it."""
    flags = "--optimizer-states bf16" + ("" if p.precision == "bf16" else " --precision bf16")
    fits = "" if need <= p.host_available else ", still more than available"
    return (f"{flags} (bf16 master weights and Adam moments, 8 B/param, rounded stochastically: "
            f"not the exact arithmetic): needs {_g(need):.1f} GiB of host RAM{fits}")
