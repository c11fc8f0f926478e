"""Atomic checkpoints in a run directory (the exported model, RUN_DIR/final/, is fitone.hf_export's).

A checkpoint is written into `checkpoints/.tmp-<tag>/`, flushed to disk, and only then renamed to
`checkpoints/<tag>/`: a process killed mid-save leaves at worst a `.tmp-*` folder, never a half
checkpoint under a real name, so `latest()` always finds the newest complete one. Leftover `.tmp-*`
folders are ignored by `latest()` and deleted when a run resumes (`remove_partial`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fitone.errors import FitoneError, RunDirError
from fitone.zero2 import cpu_adam, low_precision, wrapped_optimizer

if TYPE_CHECKING:  # engine.py imports DeepSpeed; the checkpoint functions only call its methods
    from fitone.engine import Engine

STATE_FILE = "fitone_state.json"  # written last inside a checkpoint: its presence marks it complete
PREFIX = "step-"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def is_complete(ckpt: Path) -> bool:
    return ckpt.name.startswith(PREFIX) and (ckpt / STATE_FILE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (tags sort by step)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=lambda p: p.name)


def latest(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}  # plain types for torch.load
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if not state:
        return
    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints written before it was saved lack it
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path` to disk (a rename is only as durable as what it names)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _is_write_error(exc: BaseException) -> bool:
    """Disk full or unwritable: an OSError, or torch.save's RuntimeError from its zip writer (a short write
    shows as "unexpected pos": seen on a full disk during a 7B save, bench/results/2026-11-30-issue19/)."""
    text = str(exc).lower()
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and ("write" in text or "unexpected pos" in text))


def save(engine: Engine, run_dir: str | Path, step: int, state: dict[str, Any], *, keep: int, is_main: bool,
         barrier=lambda: None) -> Path:
    """Write a complete checkpoint for `step` atomically; keep only the newest `keep`.

    A step that already has a complete checkpoint is not written again (a stop request right after a
    periodic save), so an existing checkpoint is never deleted to be replaced.
    """
    root = checkpoint_root(run_dir)
    tag = tag_for(step)
    tmp = root / f".tmp-{tag}"
    final = root / tag
    if is_complete(final):
        return final
    try:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        # DeepSpeed writes <tmp>/<tag>/: model states (rank 0) and every rank's optimizer shard
        engine.save(str(tmp), tag, client_state={"rng": rng_state()})
        barrier()
        if is_main:
            inner = tmp / tag
            (inner / STATE_FILE).write_text(json.dumps({**state, "tag": tag}, indent=2))  # marks it complete
            _fsync_tree(inner)  # the data is on disk before the name says it is complete
            shutil.rmtree(final, ignore_errors=True)  # only an incomplete leftover can be here
            os.replace(inner, final)
            _fsync_dir(root)
            shutil.rmtree(tmp)  # DeepSpeed also drops its zero_to_fp32.py helper beside the tag
            prune(run_dir, keep)
    except (OSError, RuntimeError) as exc:
        if not _is_write_error(exc):
            raise
        # disk full, quota, permissions: keep what was there and say what to do
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest(run_dir)
        kept = f"the last complete checkpoint is {last}" if last else "no earlier checkpoint exists"
        why = getattr(exc, "strerror", None) or _first_line(exc)
        raise RunDirError(f"cannot write checkpoint {final}: {why}; free disk space or fix permissions under {root}, "
                          f"then continue with --resume ({kept})") from exc
    barrier()
    return final


# What a checkpoint holds, per parameter: the model states file has the weights as trained (16 or 32 bits), the
# ZeRO-2 optimizer file the fp32 master and Adam's two fp32 moments (no gradients; half that in bf16 with
# --optimizer-states bf16, and bf16-kahan's compensation buffer). Beside them: DeepSpeed's
# zero_to_fp32.py helpers, the pickled names, shapes and slice mappings, the RNG, schedule and fitone's state
# (67 KB for the tiny models; tests/test_checkpoint.py measures the bytes written against this).
OPTIMIZER_BYTES_PER_PARAM = 12
CHECKPOINT_OVERHEAD = 4 * 2**20


def checkpoint_bytes(n_params: int, precision: str, optimizer_states: str = "fp32") -> int:
    """Disk bytes of one checkpoint of a model with `n_params` parameters trained in `precision`
    (fp16/bf16/fp32): 14 B/param in 16 bits, 16 in fp32, 8 with bf16 `optimizer_states` (10 with bf16-kahan's
    compensation), plus a little; for `--save-every`'s disk check and the plan."""
    weight_bytes = 4 if precision == "fp32" else 2
    optimizer = OPTIMIZER_BYTES_PER_PARAM if optimizer_states == "fp32" else OPTIMIZER_BYTES_PER_PARAM // 2
    optimizer += 2 if optimizer_states in low_precision.COMPENSATED else 0
    return n_params * (weight_bytes + optimizer) + CHECKPOINT_OVERHEAD


# torch.save pickles the names, shapes, slice mappings, RNG and schedule (well under 1 MiB for a 7B model) and
# Python allocates a little around it: a cushion over the largest copy, so a save near the limit is not started
SAVE_HOST_CUSHION = 64 * 2**20


def save_host_bytes(engine: Engine) -> int:
    """Host RAM a checkpoint save takes beyond what training already holds.

    DeepSpeed's ZeRO-2 save hands torch.save the model's and the optimizer's own tensors (the optimizer state
    as views of its flat buffers: stage_1_and_2.py's state_dict, no clones). torch.save writes a host tensor's
    storage from where it lies and copies any other storage to the host one at a time, dropping each copy before
    the next: so the peak adds the largest storage that is not on the host (a 16-bit weight group on a GPU; also
    the optimizer's groups with --offload none) and nothing for what the CPU offload keeps on the host.
    Measured: llama-7b's save peaked 0.24 GiB over its steps, its largest 16-bit group being 0.25 GiB
    (bench/results/2026-11-30-issue19/).
    """
    tensors = list(engine.module.state_dict().values()) + _tensors(engine.optimizer.state_dict())
    off_host = [t.untyped_storage().nbytes() for t in tensors if t.device.type != "cpu"]
    return max(off_host, default=0) + SAVE_HOST_CUSHION


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def prune(run_dir: str | Path, keep: int) -> None:
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial(run_dir: str | Path) -> None:
    """Delete folders left by a save that was killed before its rename."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def load(engine: Engine, ckpt: Path) -> dict[str, Any]:
    """Restore model, optimizer, loss scaler and LR schedule (DeepSpeed) and RNG; return fitone's state."""
    try:
        client = engine.load(str(ckpt.parent), ckpt.name)
    except FitoneError:  # already one line naming the fix (another --optimizer-states)
        raise
    except Exception as exc:  # a mismatched architecture or DeepSpeed setup fails deep inside DeepSpeed
        raise RunDirError(f"cannot load checkpoint {ckpt} ({_first_line(exc)}): it does not match this model or "
                          "its settings; resume with the options it was written with, or start over in another --out"
                          ) from exc
    set_rng_state(client.get("rng", {}))
    cpu_adam.replay_steps(wrapped_optimizer(engine.optimizer))
    return read_state(ckpt)
