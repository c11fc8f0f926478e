"""DeepSpeed engine lifecycle, in-process: distributed env, init, one micro-step, save/load, teardown.

Without a launcher DeepSpeed still wants the torch.distributed env vars; they are set here (free port,
world of one) when absent, and left alone under `deepspeed` or `torchrun`, which set them per rank.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from fitone.config import TrainConfig, resolve_precision
from fitone.errors import DeviceError
from fitone import memory


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    note: str = ""  # something the runtime changed that the user should hear about once

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> DistInfo:
    """Fill in MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE for a single process; keep a launcher's."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    return DistInfo(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))


def share_cpu_threads() -> str:
    """Give each local rank its share of the cores when torchrun left OMP_NUM_THREADS at 1.

    torchrun sets OMP_NUM_THREADS=1 for every rank when it is unset; DeepSpeedCPUAdam is OpenMP, so the
    offloaded optimizer step would run on one core per rank. Must run before cpu_adam is loaded (its
    OpenMP runtime reads the variable then). Any other value, or a run without torchrun, is left alone.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("OMP_NUM_THREADS") != "1":
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if threads == 1:
        return ""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return (f"torchrun set OMP_NUM_THREADS=1; using {threads} CPU threads per rank for CPU Adam "
            "(set OMP_NUM_THREADS to another value to choose)")


def resolve_device(cfg: TrainConfig) -> str:
    """'cuda' or 'cpu', failing early on combinations DeepSpeed would reject later with a traceback.

    Also fills in an 'auto' precision for that device (cfg is changed in place), with a note on the CPU."""
    has_cuda = memory.cuda_ready()
    device = cfg.device if cfg.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        raise DeviceError("--device cuda but no CUDA GPU is visible: use --device cpu (slow) or check the driver")
    if cfg.precision == "auto":
        cfg.precision = resolve_precision("auto", on_gpu=device == "cuda")
        if device == "cpu" and int(os.environ.get("RANK", "0")) == 0:
            print("fitone: no GPU: training in fp32 on the CPU (fp16 needs a CUDA GPU; --precision bf16 is "
                  "faster on CPUs with bf16 instructions)", flush=True)
    if device == "cpu":
        if cfg.precision == "fp16":
            raise DeviceError("fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator refuses it): "
                              "use --precision bf16 or fp32 on the CPU")
        if cfg.max_gpu_memory:
            raise DeviceError("--max-gpu-memory caps a GPU, but this run is on the CPU: drop it or use --device cuda")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"{memory.gpu_name()} has no bf16: use --precision fp16 or fp32")
    return device


def apply_gpu_cap(cfg: TrainConfig) -> None:
    cap = cfg.max_gpu_memory_bytes
    if cap is None:
        return
    try:
        memory.cap_gpu_memory(cap)
    except ValueError as exc:
        raise DeviceError(f"--max-gpu-memory {cfg.max_gpu_memory}: {exc}; give a smaller cap") from exc


_VERBOSE = False


def quiet_logs(verbose: bool) -> None:
    """DeepSpeed and transformers print a lot at init; keep it for --verbose."""
    global _VERBOSE
    _VERBOSE = verbose
    from deepspeed.utils import logger as ds_logger
    import transformers

    ds_logger.setLevel(logging.INFO if verbose else logging.ERROR)
    transformers.logging.set_verbosity(logging.INFO if verbose else logging.ERROR)
    if not verbose:
        _probe_ops_quietly()


def _probe_ops_quietly() -> None:
    """On DeepSpeed's CPU accelerator the process group's setup asks whether each op could be built, once
    per process: that compiles and links small test programs, and the one for async_io prints the
    linker's "cannot find -laio" straight to file descriptor 2, which reads like a failure and is none
    (fitone uses no async I/O). Ask first, with descriptors 1 and 2 pointed at /dev/null; the answer is
    cached, so DeepSpeed does not ask again. On CUDA nothing asks, and nothing is probed here."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if ("__compatible_ops__" in vars(deepspeed.ops)
            or get_accelerator().create_op_builder("ShareMemCommBuilder") is None):
        return
    with silenced_fds():
        deepspeed.ops.__compatible_ops__  # noqa: B018 - computed and cached on first access


@contextmanager
def silenced_fds() -> Iterator[None]:
    """Python's sys.stdout/stderr and file descriptors 1 and 2 (child processes, C code) go to /dev/null."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextmanager
def no_hf_progress_bars() -> Iterator[None]:
    """transformers' own bars (e.g. "Writing model shards" in save_pretrained) unless --verbose: fitone
    says what it saved and where."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not _VERBOSE:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on and not _VERBOSE:
            hf_logging.enable_progress_bar()


@contextmanager
def ds_chatter() -> Iterator[None]:
    """DeepSpeed prints ('... built successfully') straight to stdout; keep that for --verbose too."""
    if _VERBOSE:
        yield
        return
    with open(os.devnull, "w") as sink, redirect_stdout(sink):
        yield


def init_distributed(device: str) -> DistInfo:
    info = ensure_dist_env()
    import deepspeed

    if not torch.distributed.is_initialized():
        with ds_chatter():
            deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


def cpu_adam_built() -> bool:
    """Whether DeepSpeed's cpu_adam is already compiled in the torch extensions cache (else ~1-2 min)."""
    from pathlib import Path

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return any(root.glob("cpu_adam/*.so")) or any(root.glob("*/cpu_adam/*.so"))  # with or without a py/cuda level


def start_runtime(cfg: TrainConfig, device: str) -> DistInfo:
    """What every engine needs first, for training and probing alike: quiet logs, the process group,
    and the GPU cap."""
    from fitone.zero2 import check_version

    check_version()
    quiet_logs(cfg.verbose)
    note = share_cpu_threads()
    if device == "cuda":
        memory.use_expandable_segments(cfg.expandable_segments)  # before anything is allocated
    info = init_distributed(device)
    if device == "cuda":
        apply_gpu_cap(cfg)
    return replace(info, note=note) if note else info


def overlap_options(cfg: TrainConfig, mode: str) -> dict[str, Any]:
    """Engine keyword arguments for an update mode (fitone.ds_config.update_mode): training and the probe
    build the same engine, so the probe's trials hold what training will hold (the pipelined update's
    landing chunks on the GPU)."""
    return {"delayed_after": cfg.delayed_update_after if mode == "delayed" else None,
            "pipelined": mode == "pipelined"}


class Engine:
    """A DeepSpeed ZeRO-2 engine around a model, with the few operations training and probing need."""

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], *, delayed_after: int | None = None,
                 pipelined: bool = False):
        """delayed_after: start the one-step delayed parameter update after that many plain steps;
        pipelined: the pipelined update from the second step, on the lean host layout (fitone.zero2).
        Default: DeepSpeed's step."""
        import deepspeed

        from fitone.zero2 import layout, overflow, overlap

        start = time.perf_counter()
        self.host: layout.LeanHost | None = None
        if pipelined:
            ds_config = layout.lean_offload_config(ds_config)
        self.ds_config = ds_config
        with ds_chatter():
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=layout.param_groups(model), config=ds_config)
        self.overflow_deferred = overflow.defer_overflow_check(self.optimizer)  # same decision, one sync a step
        self.overlap: overlap.DelayedUpdate | overlap.PipelinedUpdate | None = None
        if delayed_after is not None:
            self.overlap = overlap.DelayedUpdate(self.optimizer, after=delayed_after)
        elif pipelined:
            self.host = layout.LeanHost(self.optimizer)
            self.overlap = overlap.PipelinedUpdate(self.optimizer, self.ds.module, after=1)
        memory.trim_heap()  # the model's host copy, moved to the GPU, would otherwise stay in the RSS
        self.init_s = time.perf_counter() - start

    def sync_weights(self) -> None:
        """Apply a pending overlapped update to the weights (no-op without one): before anything reads them."""
        if self.overlap is not None:
            self.overlap.sync()

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return self.ds(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        if self.overlap is not None:
            self.overlap.before_backward()
        self.ds.backward(loss)

    def step(self) -> None:
        """Optimizer step at accumulation boundaries (DeepSpeed counts micro-steps itself)."""
        self.ds.step()

    @property
    def skipped_steps(self) -> int:
        return self.ds.skipped_steps

    @property
    def last_step_applied(self) -> bool:
        return bool(getattr(self.ds, "_step_applied", True))

    @property
    def loss_scale(self) -> float | None:
        if "fp16" not in self.ds_config:
            return None
        return float(getattr(self.optimizer, "loss_scale", 0.0) or 0.0)

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def reset_after_oom(self) -> None:
        """Make the engine usable after an out-of-memory error in backward or in the optimizer step."""
        from fitone.zero2.oom import reset_after_oom

        self.sync_weights()  # an overlapped update still in flight reads the host buffers reset below
        reset_after_oom(self.ds, self.optimizer)
        memory.free_memory()

    def save(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        self.sync_weights()
        self.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, load_dir: str, tag: str) -> dict[str, Any]:
        from fitone.zero2.layout import loading_across_layouts

        with loading_across_layouts(self.ds, self.optimizer):  # a checkpoint from before bounded groups too
            _path, client_state = self.ds.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                                          load_lr_scheduler_states=True)
        if _path is None:
            raise FileNotFoundError(f"{load_dir}/{tag}")
        if self.overlap is not None:  # a resumed run past its plain steps continues overlapped, as it would have
            self.overlap.applied = self.ds.global_steps - self.ds.skipped_steps
        return client_state or {}

    def close(self) -> None:
        """Free the engine's GPU and pinned host memory so a notebook can run another."""
        try:
            if self.overlap is not None:
                self.overlap.close()
            self.ds.destroy()
        finally:
            if self.host is not None:  # unlock the pages even when a teardown step failed, before they are freed
                self.host.close()
            del self.ds, self.optimizer, self.scheduler, self.overlap, self.host
            memory.free_memory()
