"""The process's runtime, set up once per run: device, distributed env, CPU threads, log levels, GPU cap.

`resolve_device(cfg)` and `ensure_dist_env()` are what fitone.run's `resolve` asks of this machine; they are
cheap, so the checks that need the world size run before anything heavy. `Runtime.start()` does the rest
once: DeepSpeed's version check, quiet logs, the process group and the GPU cap. Training builds one Runtime
(`Run.runtime()`) and hands it to the probe; a standalone probe builds its own.
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Iterator

import torch

from fitone import extensions, memory
from fitone.config import TrainConfig
from fitone.errors import DeviceError
from fitone.zero2 import check_version
from fitone.zero2.ops import probe_ops_quietly, shm_comm_needed


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None = None  # ranks on this node; None: all of them (one node)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ranks_on_node(self) -> int:
        """The ranks whose host RAM this node holds: the launcher's local world size, else every rank."""
        return self.local_world_size or self.world_size

    @property
    def nodes(self) -> int:
        """The machines the ranks run on, `ranks_on_node` on each (a last one may have fewer)."""
        return -(-self.world_size // self.ranks_on_node)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_port_chosen_here: str | None = None  # the MASTER_PORT this process picked for itself, ours to change if it is
# taken; one set since (a notebook's next cell) is the user's. Not a variable in os.environ: a launcher's ranks
# started from this process would inherit it


def ensure_dist_env() -> DistInfo:
    """Fill in MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE for a single process; keep a launcher's."""
    global _port_chosen_here
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = _port_chosen_here = str(_free_port())
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        return DistInfo(0, 0, 1, 1)  # a stale LOCAL_WORLD_SIZE does not count here
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    return DistInfo(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world, _local_world_size(world))


def _local_world_size(world: int) -> int | None:
    """The ranks a launcher started on this node: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's launcher's LOCAL_SIZE.
    Without either (another launcher) None: every rank is counted on this node, which never under-counts."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and 1 <= int(value) <= world:
            return int(value)
    return None


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
    """'cuda' or 'cpu', failing early on combinations DeepSpeed would reject later with a traceback. An 'auto'
    precision is not checked here: fitone.run resolves it for the device this returns."""
    has_cuda = memory.cuda_ready()
    device = cfg.device if cfg.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        raise DeviceError("--device cuda but no CUDA GPU is visible: use --device cpu (slow) or check the driver")
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


def apply_gpu_cap(cap_bytes: int | None, given: str | None) -> None:
    """Cap the CUDA allocator at `cap_bytes` (`given`: the flag's text, for the error)."""
    if cap_bytes is None:
        return
    try:
        memory.cap_gpu_memory(cap_bytes)
    except ValueError as exc:
        raise DeviceError(f"--max-gpu-memory {given}: {exc}; give a smaller cap") from exc


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
        probe_ops_quietly(silenced_fds)


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


def _port_in_use(exc: Exception, attempt: int) -> None:
    """MASTER_PORT is taken. The free port fitone picked can be taken before the store binds it (seen once in the
    GPU lane): pick another. One the user or a launcher set is never moved (another process would wait on it):
    one line naming the fix."""
    global _port_chosen_here
    port = os.environ.get("MASTER_PORT")
    if port == _port_chosen_here and attempt < 2:
        os.environ["MASTER_PORT"] = _port_chosen_here = str(_free_port())
        return
    if port == _port_chosen_here:
        raise exc
    fix = ("give the launcher a free one (torchrun --master-port, deepspeed --master_port)"
           if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1 else
           "unset MASTER_PORT to let fitone pick a free port, or set it to a free one")
    raise DeviceError(f"MASTER_PORT {port} is in use by another process (EADDRINUSE): {fix}") from exc


def init_distributed(device: str) -> DistInfo:
    info = ensure_dist_env()
    import deepspeed

    backend = "nccl" if device == "cuda" else "gloo"
    for attempt in range(3):
        if torch.distributed.is_initialized():
            break
        try:
            with ds_chatter():
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
        except torch.distributed.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            _port_in_use(exc, attempt)
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


class Placement:
    """Where a run's engines live (`device`) and which rank of how many this process is (`dist`): the one
    definition of 'runs on a GPU', for the Run that decides it and the Runtime that starts it."""

    device: str  # 'cuda' or 'cpu'
    dist: DistInfo

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


@dataclass
class Runtime(Placement):
    """The process's setup for a run's placement: started once, closed at the end."""

    device: str  # 'cuda' or 'cpu'
    dist: DistInfo
    verbose: bool = False
    expandable_segments: bool = True
    cap_bytes: int | None = None  # the GPU cap start() applies (fitone.run parsed --max-gpu-memory)
    max_gpu_memory: str | None = None  # as given, for its error
    started: bool = False
    owns_group: bool = False  # start() made the process group (not the caller's own init_process_group)

    def start(self) -> str:
        """What every engine needs first, for training and probing alike: quiet logs, the process group and
        the GPU cap. Once per Runtime; returns a note the user should hear once ('' for none)."""
        if self.started:
            return ""
        check_version()
        quiet_logs(self.verbose)
        note = share_cpu_threads()
        if self.on_gpu:
            memory.use_expandable_segments(self.expandable_segments)  # before anything is allocated
        self.owns_group = not torch.distributed.is_initialized()
        if shm_comm_needed():  # built by DeepSpeed's process group setup, on the CPU accelerator
            extensions.prepare_build("deepspeed_shm_comm")
        self.dist = init_distributed(self.device)
        if self.on_gpu:
            apply_gpu_cap(self.cap_bytes, self.max_gpu_memory)
        self.started = True
        return note

    def close(self) -> None:
        """Destroy the process group start() made, at the end of a run (also after an error): torch warns
        at exit about one left alive, and a notebook's next run starts its own. A group the caller made is
        theirs to keep."""
        if self.started and self.owns_group and torch.distributed.is_initialized():
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups of it
        self.started = self.owns_group = False

    # the same decisions on every rank (one rank alone would wait in a collective the others never join)
    def agree(self, *flags: bool) -> list[bool]:
        """Each flag raised on any rank is raised on all: a signal, NaN or full host RAM seen by one rank stops
        all (alone, it would wait in the save's barrier while the others wait in the next step's all-reduce)."""
        if self.world_size == 1:
            return list(flags)
        import torch.distributed as dist

        votes = torch.tensor([float(f) for f in flags], device=self._torch_device())
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return [bool(v) for v in votes.tolist()]

    def mean_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=self._torch_device())
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item()) / self.world_size

    def _torch_device(self) -> torch.device:
        # where DeepSpeed puts this rank's engine, and so where its collectives run
        return torch.device(f"cuda:{self.dist.local_rank}") if self.on_gpu else torch.device("cpu")
