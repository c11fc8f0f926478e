"""What every script in scripts/ shares: the checkout on the path, child processes' environment, the GPU cap,
records with the exact command that made them, and the results they write (bench/README.md).

Importing this loads no torch: a parent that only schedules children stays light (its helpers that need
torch import it when called).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
GIB = 1024**3  # = fitone.units.GIB; importing fitone here would load torch in a parent that only schedules
for _path in (SCRIPTS, ROOT):  # the checkout's fitone before an installed one; the helpers importable
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def env_flag(name: str) -> bool:
    """A dry-run switch such as FITONE_PACK_DRY_RUN: set and not '0'."""
    return os.environ.get(name, "") not in ("", "0")


def command(script: str, argv: list[str], python: str = "python") -> str:
    """The command line a record keeps, so it can be re-run as it was (bench/README.md maps old names)."""
    return shlex.join([python, script, *argv])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_env(**extra: str) -> dict[str, str]:
    """This environment for a child, with the checkout's fitone first on its path."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def child_env(**extra: str) -> dict[str, str]:
    """checkout_env and what DeepSpeed needs to run without its launcher (one rank), output unbuffered."""
    return checkout_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                        WORLD_SIZE="1", PYTHONUNBUFFERED="1", **extra)


def stop_group(proc: subprocess.Popen, wait: float = 15) -> None:
    """SIGTERM a child's process group (its compiler and helper children too), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def cap_gpu(cap: str | None, device: str = "cuda") -> None:
    """Stand for a smaller card: cap the CUDA allocator before the first allocation, as --max-gpu-memory does."""
    if cap and device == "cuda":
        from fitone.memory import cap_gpu_memory
        from fitone.units import parse_size

        cap_gpu_memory(parse_size(cap))


def gpu_name(device: str = "cuda") -> str:
    """The GPU's name without creating a CUDA context here (nvidia-smi, else a throwaway child)."""
    if device == "cpu":
        return "cpu"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[-1]
    return "unknown-gpu"


def cpu_model() -> str | None:
    """/proc/cpuinfo's model name and this process's core count (None where there is no /proc)."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        return None
    return f"{names[0]} x {len(os.sched_getaffinity(0))}" if names else None


def machine(dry_run: bool = False) -> dict[str, Any]:
    """Where a result folder's numbers come from: GPU, CPU, versions, commit, date."""
    from importlib.metadata import version

    import torch

    try:  # a copy of the tree may have no .git, or no git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
        "cpu": cpu_model(),  # a CPU run's rounding follows the instruction set its kernels pick
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the one they picked (ATEN_CPU_CAPABILITY)
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "deepspeed": version("deepspeed"),
        "commit": commit,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "dry_run": dry_run,
    }


def model_task(model: str) -> str:
    """'causal' or 'seq2seq' (fitone.models' names) from the model's config file. The parent reads the JSON
    itself: importing transformers (and torch) here costs tens of seconds on a busy machine. What the file
    does not settle goes through fitone.models (ValueError with its message if it cannot load it)."""
    for path in (ROOT / "fitone" / "model_configs" / f"{model}.json", Path(model, "config.json")):
        if path.is_file():
            values = json.loads(path.read_text())
            if "is_encoder_decoder" in values:
                return "seq2seq" if values["is_encoder_decoder"] else "causal"
            names = values.get("architectures") or []
            if names and all(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
                return "causal"
            break
    from fitone.errors import FitoneError
    from fitone.models import load_config, task_of

    try:
        return task_of(load_config(model, from_scratch=True))
    except FitoneError as exc:
        raise ValueError(str(exc)) from exc


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def resolve_out(out: str | None, gpu: str, date: str) -> Path:
    """A results file: --out as given, or <date>-<gpu>.json inside --out (a directory) or bench/results/."""
    name = f"{date}-{slug(gpu)}.json"
    if out is None:
        return ROOT / "bench" / "results" / name
    path = Path(out)
    if out.endswith(os.sep) or path.is_dir():
        return path / name
    return path


def load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise SystemExit(f"{path} does not hold a list of records; give another --out")
    return data


def write_json(path: Path, value: Any, indent: int = 1) -> None:
    """Rewrite the whole file through a temporary one, so a kill mid-write leaves the last good file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=indent, default=str) + "\n")
    tmp.replace(path)


def num(value: Any, fmt: str) -> str:
    """A number for a table cell, '-' where there is none."""
    return format(value, fmt) if isinstance(value, (int, float)) else "-"
