"""The tool comparison's child side (scripts/bench_tools.py starts one per tool x size): the line protocol
to the parent, the heartbeat, and the measuring helpers every tool's loop shares."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from _harness import GIB, cap_gpu

RECORD = "BENCH_RECORD "  # a child's final record for one batch size, one JSON object per line
PARTIAL = "BENCH_PARTIAL "  # what a child knows so far; kept when it dies or times out
HEARTBEAT_S = 10  # how often a child reports its host RSS, so one killed by the kernel still says how far it got


_EMIT_LOCK = threading.Lock()


def emit(prefix: str, values: dict[str, Any]) -> None:
    """One whole line per record: the heartbeat thread emits too, and print() writes the text and its
    newline separately, so two threads' lines could interleave and break the parent's JSON parsing."""
    line = prefix + json.dumps(values, default=str) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def child_main(job: dict[str, Any]) -> int:
    """Run the job's tool, print one RECORD line per batch size. Errors become records, not tracebacks only."""
    import _tools_hf
    import _tools_measure

    emit(PARTIAL, {"started": time.time()})
    start_heartbeat()
    measure: Callable[[dict[str, Any]], Iterator[dict[str, Any]]] = {
        "deepspeed": _tools_measure.measure_deepspeed, "hf-trainer": _tools_hf.measure_hf_trainer,
        "hf-trainer-auto-find": _tools_hf.measure_hf_auto_find, "torch-plain": _tools_measure.measure_torch,
        "torch-plain-uncapped": _tools_measure.measure_torch,
    }.get(job["tool"], _tools_measure.measure_fitone)  # fitone and its variants
    done: set[int] = set()
    try:
        for rec in measure(job):
            rec.update(environment())
            emit(RECORD, rec)
            done.add(rec["batch_size"])
    except Exception as exc:  # every failure must become a record the parent can show
        traceback.print_exc()
        for size in job["sizes"]:
            if size not in done:
                emit(RECORD, {"batch_size": size, **failure_fields(exc), **environment()})
                if failure_fields(exc)["oom"]:
                    break
    return 0


def start_heartbeat(every: float = HEARTBEAT_S) -> None:
    """Report this process's peak host RSS every few seconds (a daemon thread). A child the kernel kills for
    host memory prints nothing more, so its record keeps the last value seen (a lower bound) and the phase."""

    t0 = time.perf_counter()

    def beat() -> None:
        while True:
            time.sleep(every)
            with contextlib.suppress(Exception):
                emit(PARTIAL, {"peak_host_gib_last_seen": host_peak_gib(),
                               "last_seen_s": round(time.perf_counter() - t0, 1)})

    threading.Thread(target=beat, name="bench-heartbeat", daemon=True).start()


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """oom + its message for an out-of-memory error (also fitone's MemoryBudgetError), else error."""
    from fitone.memory import is_oom_error

    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0][:400]
    if is_oom_error(exc) or type(exc).__name__ == "MemoryBudgetError" or "out of memory" in text.lower():
        return {"oom": True, "oom_message": first}
    return {"oom": False, "error": first}


def environment() -> dict[str, Any]:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "accelerate"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"versions": versions, **({"gpu": gpu} if gpu else {})}


def syncer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def train_config(job: dict[str, Any], size: int, **extra: Any):
    """The fitone TrainConfig every tool shares (the DeepSpeed config and the batch come from it)."""
    from fitone.config import TrainConfig

    return TrainConfig(model=job["model"], from_scratch=True, data="synthetic", src_len=job["src_len"],
                       tgt_len=job["tgt_len"], seq_len=job["seq_len"], batch_size=size, precision=job["precision"],
                       max_gpu_memory=job["cap"], activation_checkpointing=job["activation_checkpointing"],
                       progress=True, out=None, seed=job["seed"], device=job["device"], **extra)  # the bar goes


def model_config(job: dict[str, Any]):
    """The model's config; a causal LM's seq_len beyond its positions is refused here, before any build."""
    from fitone.models import CAUSAL, check_seq_len, load_config, task_of

    config = load_config(job["model"], from_scratch=True)
    if task_of(config) == CAUSAL:
        check_seq_len(config, job["seq_len"], job["model"])
    return config


def param_count(config) -> int:
    from fitone.models import build_model

    return sum(p.numel() for p in build_model(config, meta=True).parameters())


def build_on_cpu(job: dict[str, Any], checkpointing: bool = True):
    """(model, config, params, build_s): the model from its shipped config on the CPU, seeded like every
    other tool's, with activation checkpointing switched on the way fitone does it (unless `checkpointing`
    is False: HF Trainer switches it on itself)."""
    import torch

    from fitone.models import build_model, enable_activation_checkpointing

    config = model_config(job)
    emit(PARTIAL, {"phase": "model build"})
    t0 = time.perf_counter()
    torch.manual_seed(job["seed"])
    model = build_model(config)
    if checkpointing and job["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    return model, config, sum(p.numel() for p in model.parameters()), round(time.perf_counter() - t0, 2)


def make_batch(job: dict[str, Any], config, size: int, device) -> dict[str, Any]:
    """One batch at the full lengths (random tokens), reused every step: shapes, not data, set the cost."""
    from fitone.data import worst_case_batch
    from fitone.models import task_of

    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    batch = worst_case_batch(task_of(config), size, train_config(job, size).data_settings(), config.vocab_size, pad)
    return {k: v.to(device) for k, v in batch.items()}


def cap_memory(job: dict[str, Any]) -> None:
    """Cap the CUDA allocator before the first allocation, as fitone's --max-gpu-memory does."""
    cap_gpu(job["cap"], job["device"])


def reset_gpu_peak() -> None:
    from fitone.memory import reset_gpu_peak as reset

    reset()


def gpu_peak_gib() -> float:
    from fitone.memory import gpu_peak_bytes

    return round(gpu_peak_bytes() / GIB, 3)


def end_init() -> float:
    """The GPU peak of building the model/engine (GiB); then the peak restarts for the steps."""
    peak = gpu_peak_gib()
    reset_gpu_peak()
    return peak


def gpu_peaks() -> dict[str, float]:
    from fitone.memory import gpu_peak_bytes, gpu_reserved_peak_bytes

    return {"peak_gpu_gib": round(gpu_peak_bytes() / GIB, 3),
            "peak_gpu_reserved_gib": round(gpu_reserved_peak_bytes() / GIB, 3)}


def host_peak_gib() -> float:
    """Peak resident memory of this process so far (the kernel's high-water mark)."""
    import resource

    from fitone.memory import host_rss_bytes

    return round(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, host_rss_bytes()) / GIB, 3)


def load_cpu_adam() -> float:
    """Load (JIT-compiling on a fresh machine) DeepSpeed's CPU Adam op up front, so init_s leaves it out."""
    t0 = time.perf_counter()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    return round(time.perf_counter() - t0, 2)


def summarise(times: list[float], skipped: list[bool] | None, size: int) -> dict[str, Any]:
    """step_s = median of the timed steps that were not skipped (fp16 overflow), with their [min, max]."""
    skipped = skipped if skipped is not None and len(skipped) == len(times) else [False] * len(times)
    kept = [t for t, s in zip(times, skipped) if not s] or list(times)
    if not kept:
        return {"step_s": None, "step_s_spread": None, "samples_per_s": None, "step_times": []}
    step = statistics.median(kept)
    return {"step_s": round(step, 4), "step_s_spread": [round(min(kept), 4), round(max(kept), 4)],
            "samples_per_s": round(size / step, 2), "step_times": [round(t, 4) for t in times],
            "timed_skipped": sum(skipped), **({"warning": "every timed step was skipped (fp16 overflow)"}
                                              if all(skipped) and times else {})}


def median_parts(parts: list[dict[str, float]]) -> dict[str, float] | None:
    """Per-key median over steps (keys missing from a step count as 0 there)."""
    if not parts:
        return None
    keys = sorted({k for p in parts for k in p})
    return {k: round(statistics.median(p.get(k, 0.0) for p in parts), 4) for k in keys}


def loss_fields(losses: list[float]) -> dict[str, Any]:
    return {"loss_first": round(losses[0], 4) if losses else None,
            "loss_last": round(losses[-1], 4) if losses else None}


def run_steps(one_step: Callable[[], bool], job: dict[str, Any],
              before_extra: Callable[[], None] | None = None) -> tuple[list[float], list[bool], int, int]:
    """Warm up; keep warming (up to 10 more steps) while fp16 loss scaling still skips steps; time `steps`
    steps; then run `split_steps` more after `before_extra`. `one_step` runs a step between syncs and
    returns whether it was skipped. Returns (step times, skipped flags, first timed, end of timed)."""
    times: list[float] = []
    skipped: list[bool] = []

    def timed_step() -> None:
        t0 = time.perf_counter()
        skipped.append(one_step())
        times.append(time.perf_counter() - t0)

    for _ in range(job["warmup"]):
        timed_step()
    for _ in range(10):
        if not (job["warmup"] and skipped and skipped[-1]):
            break
        timed_step()
    first = len(times)
    for _ in range(job["steps"]):
        timed_step()
    last = len(times)
    if job["split_steps"] and before_extra:
        before_extra()
        for _ in range(job["split_steps"]):
            timed_step()
    return times, skipped, first, last
