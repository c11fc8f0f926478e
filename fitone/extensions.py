"""DeepSpeed's JIT-built ops (cpu_adam, shm_comm) and fitone's own (`load_native`): whether each is built, the line
fitone says before a build, and the build lock an interrupted build leaves behind.

torch builds an extension in its folder under TORCH_EXTENSIONS_DIR (default `~/.cache/torch_extensions/
<python>_<accelerator>/`) behind a `lock` file that the builder creates exclusively and keeps open until the
build ends and it deletes the file; every other process waits for the file to go, silently and forever. A
build killed mid-way (a timeout, Ctrl-C, the OOM killer) leaves the file, and every later run hangs.

A lock is stale when no live process has it open (Linux: /proc/<pid>/fd). An age limit was the other
choice, but a build on a loaded 2-core machine takes from one to ten or more minutes, so no age tells a slow
build from a dead one; the open descriptor does, in milliseconds. A stale lock is deleted (the build's ninja
log redoes whatever the killed build left unfinished). Where the holder cannot be seen (no /proc, a process
of the lock's owner fitone may not inspect), fitone says so in one line and waits. A builder on another
machine sharing the folder is not seen.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fitone import notice

OPS = {"cpu_adam": "DeepSpeed's CPU Adam", "deepspeed_shm_comm": "DeepSpeed's shared-memory collectives (shm_comm)",
       "fitone_adam16": "fitone's fused 16-bit Adam step",
       "fitone_adam32": "fitone's exact fp32 AdamW from 16-bit gradients",
       "fitone_ds_adam": "fitone's GIL-releasing call of DeepSpeed's CPU Adam"}
# built with nvcc where a GPU is (per GPU architecture), never on a CPU-only machine
CUDA_OPS = {"fitone_adam_gpu": "fitone's exact fp32 AdamW on the GPU (--gpu-adam-share)"}
BUILD_TIME = {"fitone_adam_gpu": "~1 minute", "fitone_adam16": "~1 minute on 2 cores",
              "fitone_adam32": "~1.5 minutes on 2 cores", "fitone_ds_adam": "~0.5 minutes on 2 cores"}  # others: 1.5
# fitone's own ops build with -march=native, so each CPU's instruction set gets its folder: a build cached where
# several machines share it (a cluster's home directory) would stop the next CPU with an illegal instruction
NATIVE_OPS = {"fitone_adam16", "fitone_adam32", "fitone_ds_adam"}
# no FMA contraction: each operation rounds once, as its source writes it, whatever SIMD level the compiler targets
# (-fno-math-errno lets sqrt vectorize; it changes no result)
NATIVE_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fopenmp"]
RECHECK_S = 0.5  # a lock with no holder is looked at twice: its builder closes it just before deleting it


def _say(text: str) -> None:
    notice.say(text)  # one line per run, not one per rank


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its default cache folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def cpu_fingerprint(cpuinfo: str | None = None) -> str:
    """8 hex digits naming this CPU's instruction-set extensions (Linux: /proc/cpuinfo's flags), else its model."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = next((line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))),
                 f"{platform.machine()} {platform.processor()}")
    return hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]


@functools.cache
def _this_cpu() -> str:
    return cpu_fingerprint()  # read once a process: the CPU does not change under it


def build_name(name: str) -> str:
    """The name op `name` builds under: fitone's -march=native ops carry this CPU's fingerprint."""
    return f"{name}_{_this_cpu()}" if name in NATIVE_OPS else name


def build_dirs(name: str) -> list[Path]:
    """The op's build folders: `root/name` (TORCH_EXTENSIONS_DIR) or `root/<python>_<accelerator>/name`."""
    name = build_name(name)
    root = extensions_root()
    return [d for d in [root / name, *sorted(root.glob(f"*/{name}"))] if d.is_dir()]


def is_built(name: str) -> bool:
    """Whether the op is already compiled in the extensions cache (else its first engine builds it)."""
    return any(any(d.glob("*.so")) for d in build_dirs(name))


def lock_holders(lock: Path) -> list[int] | None:
    """The live processes that have `lock` open; None where that cannot be told."""
    try:
        target = os.stat(lock)
    except FileNotFoundError:
        return []
    if not os.path.isdir("/proc/self/fd"):
        return None
    holders, unseen = [], False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            try:
                unseen |= os.stat(f"/proc/{pid}").st_uid == target.st_uid  # one that could have built here
            except FileNotFoundError:
                pass
            continue
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                holders.append(int(pid))
                break
    return None if unseen and not holders else holders


def clear_stale_lock(lock: Path, what: str, say: Callable[[str], None] = _say, poll_s: float = 1.0) -> None:
    """Return once `lock` is gone: deleted here when no process holds it, else after its builder is done."""
    said = False
    while lock.exists():
        holders = lock_holders(lock)
        if holders == []:
            time.sleep(RECHECK_S)
            if lock.exists() and lock_holders(lock) == []:
                lock.unlink(missing_ok=True)
                say(f"removed {lock}, left by an interrupted build of {what} (no process holds it)")
            continue
        if not said:
            said = True
            say(f"waiting for process {holders[0]}, which is building {what} ({lock})" if holders else
                f"waiting on {lock}, which no process fitone can inspect holds: delete it if no build of "
                f"{what} is running")
        time.sleep(poll_s)


def prepare_build(name: str, say: Callable[[str], None] = _say, folder: str | None = None) -> None:
    """Before DeepSpeed loads op `name`: no stale lock left in its way, and one line if it is about to build.
    `folder`: the build's name where it is not build_name(name) (a CUDA op's, per GPU architecture)."""
    what = OPS.get(name) or CUDA_OPS[name]
    folders = build_dirs(name) if folder is None else [d for d in [extensions_root() / folder] if d.is_dir()]
    for d in folders:
        clear_stale_lock(d / "lock", what, say)
    if not any(any(d.glob("*.so")) for d in folders):
        say(f"building {what} once for this machine ({BUILD_TIME.get(name, '~1.5 minutes on 2 cores')}; "
            f"cached in {extensions_root()})")


_loaded: dict[str, Any] = {}
_loading = threading.Lock()


def load_native(name: str, source: Path) -> Any:
    """fitone's own op `name` (one of NATIVE_OPS) from its C++ `source`: built with NATIVE_CFLAGS on the first call
    of this machine (one line says so), then loaded from the cache, once a process."""
    with _loading:
        if name not in _loaded:
            from torch.utils.cpp_extension import load

            prepare_build(name)
            # not linked to an OpenMP library of its own (as DeepSpeed's cpu_adam is not): its OpenMP calls bind to
            # the one torch loaded. A CUDA torch bundles libgomp under another soname, so `-fopenmp` at the link
            # would load the system's beside it, a second pool of threads spinning against torch's
            _loaded[name] = load(name=build_name(name), sources=[str(source)], extra_cflags=NATIVE_CFLAGS,
                                 verbose=False)
    return _loaded[name]


def load_cuda(name: str, source: Path, build_name: str) -> Any:
    """fitone's CUDA op `name` (one of CUDA_OPS) from its `source`, built by nvcc under `build_name` (one per GPU
    architecture) on the first call of this machine, then loaded from the cache, once a process. Its kernels round
    each operation by intrinsics, so no flag changes a bit."""
    with _loading:
        if name not in _loaded:
            from torch.utils.cpp_extension import load

            prepare_build(name, folder=build_name)
            _loaded[name] = load(name=build_name, sources=[str(source)], extra_cuda_cflags=["-O3"], verbose=False)
    return _loaded[name]
