"""Memory readings, OOM detection and cleanup. Imports nothing of fitone but its units, so everything can use it."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import psutil
import torch

from fitone.units import GIB


_OOM_MESSAGES = (
    "CUDA out of memory",
    "out of memory",  # generic allocator / cuDNN / cuBLAS wording
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of saying it had no workspace
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """True when `exc` means 'this batch did not fit' (as accelerate's should_reduce_batch_size)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError) and len(exc.args) == 1:
        return any(msg in str(exc.args[0]) for msg in _OOM_MESSAGES)
    return False


def free_memory() -> None:
    """Release what a failed or finished attempt left behind: Python garbage, freed heap, then the CUDA cache."""
    gc.collect()
    trim_heap()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def trim_heap() -> bool:
    """Hand freed heap pages back to the OS; False where the C library has no malloc_trim (not glibc).

    glibc keeps freed blocks under its mmap threshold (up to 32 MiB) in the heap, so the CPU copy of a
    model built on the host and moved to the GPU stays in the RSS (bench/NOTES.md, issue 19's t5-3b).
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def gpu_total_bytes(device: int | None = None) -> int | None:
    if not cuda_ready():
        return None
    return torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).total_memory


def gpu_free_bytes() -> int | None:
    if not cuda_ready():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free


def gpu_name() -> str:
    return torch.cuda.get_device_name() if cuda_ready() else "cpu"


def cap_gpu_memory(cap_bytes: int) -> float:
    """Cap this process's CUDA allocator at `cap_bytes` (to stand for a smaller card). Returns the fraction."""
    total = gpu_total_bytes()
    if total is None:
        raise ValueError("no CUDA device to cap")
    if cap_bytes > total:
        raise ValueError(f"cap {cap_bytes / GIB:.1f} GiB is larger than the GPU's {total / GIB:.1f} GiB")
    fraction = cap_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def allocator_settings(expandable_segments: bool) -> str:
    """The CUDA caching allocator's settings a run gets: the user's PYTORCH_CUDA_ALLOC_CONF (or
    PYTORCH_ALLOC_CONF) as given, which fitone leaves alone; else expandable segments or nothing."""
    given = _given_allocator_settings()
    if given is not None:
        return given
    return "expandable_segments:True" if expandable_segments else ""


def _given_allocator_settings() -> str | None:
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")


def use_expandable_segments(enabled: bool) -> bool:
    """Switch the CUDA caching allocator to expandable segments, before the first allocation.

    Without them a long-lived process fragments: a t5-3b probe on a 23 GiB cap saw micro-batch 306
    run out of memory after an earlier out-of-memory trial, while a fresh process trained it. An
    allocator setting the user gave is left alone (`allocator_settings`). Returns whether expandable
    segments are on.
    """
    given = _given_allocator_settings()
    if given is not None:
        return "expandable_segments:true" in given.replace(" ", "").lower()
    if enabled:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10's name
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    return enabled


def reset_gpu_peak() -> None:
    if cuda_ready():
        torch.cuda.reset_peak_memory_stats()


def gpu_peak_bytes() -> int:
    """Peak bytes the CUDA allocator handed out since the last reset (0 without a GPU)."""
    return torch.cuda.max_memory_allocated() if cuda_ready() else 0


def gpu_reserved_peak_bytes() -> int:
    return torch.cuda.max_memory_reserved() if cuda_ready() else 0


def host_rss_bytes() -> int:
    """Resident memory of this process."""
    return psutil.Process(os.getpid()).memory_info().rss


def host_available_bytes() -> int:
    """RAM this process can still take: the machine's available memory, or less where a container's
    cgroup limit leaves less (its OOM killer acts at the limit, whatever the machine has free)."""
    free = psutil.virtual_memory().available
    container = cgroup_memory()
    return free if container is None else min(free, max(0, container[0] - container[1]))


def host_used_fraction() -> float:
    used = psutil.virtual_memory().percent / 100.0
    container = cgroup_memory()
    return used if container is None else max(used, container[1] / container[0])


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# (limit file, usage file, reclaimable page cache in memory.stat) for cgroup v2 and v1
_CGROUP_FILES = (("memory.max", "memory.current", "inactive_file"),
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def cgroup_memory(root: Path | None = None, proc: Path | None = None) -> tuple[int, int] | None:
    """(limit, used) bytes of the tightest cgroup memory limit on this process, or None when there is
    none below the machine's RAM. `used` leaves out inactive page cache, which the kernel reclaims before
    it kills (as `docker stats` counts). Reads cgroup v2 (memory.max) and v1 (memory.limit_in_bytes),
    from this process's own group up to the root, since a parent's limit binds the children too."""
    root, proc = root or CGROUP_ROOT, proc or PROC_CGROUP
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    machine = psutil.virtual_memory().total
    best: tuple[int, int] | None = None
    for line in lines:
        _id, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy
            base, files = root, _CGROUP_FILES[0]
        elif "memory" in controllers.split(","):
            base, files = root / "memory", _CGROUP_FILES[1]
        else:
            continue
        for folder in _ancestors(base, path.strip()):
            found = _read_limit(folder, *files)
            if found is not None and found[0] < machine and (best is None or found[0] < best[0]):
                best = found
    return best


def _ancestors(base: Path, path: str) -> list[Path]:
    """The group's folder and each parent up to `base` (inside a container the path may not exist)."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_limit(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> tuple[int, int] | None:
    try:
        text = (folder / limit_file).read_text().strip()
        if text == "max":
            return None
        limit, used = int(text), int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        used -= int(stat.get(inactive_key, 0))
    except (OSError, ValueError):
        pass
    return limit, max(0, used)
