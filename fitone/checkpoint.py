"""Atomic checkpoints in a run directory.

A checkpoint is written into `checkpoints/.tmp-<tag>/`, flushed to disk, and only then renamed to
`checkpoints/<tag>/`: a process killed mid-save leaves at worst a `.tmp-*` folder, never a half
checkpoint under a real name, so `latest()` always finds the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "fitone_state.json"  # written last inside a checkpoint: its presence marks it complete
PREFIX = "step-"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if not state:
        return
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(engine, run_dir: str | Path, step: int, state: dict[str, Any], *, keep: int, is_main: bool,
         barrier=lambda: None) -> Path:
    """Write a complete checkpoint for `step` atomically; keep only the newest `keep`."""
    root = checkpoint_root(run_dir)
    tag = tag_for(step)
    tmp = root / f".tmp-{tag}"
    final = root / tag
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # DeepSpeed writes <tmp>/<tag>/: model states (rank 0) and every rank's optimizer shard
    engine.save(str(tmp), tag, client_state={"rng": rng_state()})
    barrier()
    if is_main:
        inner = tmp / tag
        (inner / STATE_FILE).write_text(json.dumps({**state, "tag": tag}, indent=2))
        _fsync_tree(inner)
        if final.exists():
            shutil.rmtree(final)
        os.replace(inner, final)
        shutil.rmtree(tmp)  # DeepSpeed also drops its zero_to_fp32.py helper beside the tag
        _fsync_tree_dir(root)
        prune(run_dir, keep)
    barrier()
    return final


def _fsync_tree_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(run_dir: str | Path, keep: int) -> None:
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial(run_dir: str | Path) -> None:
    """Delete folders left by a save that was killed before its rename."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def load(engine, ckpt: Path) -> dict[str, Any]:
    """Restore model, optimizer, loss scaler and LR schedule (DeepSpeed) and RNG; return fitone's state."""
    client = engine.load(str(ckpt.parent), ckpt.name)
    set_rng_state(client.get("rng", {}))
    return read_state(ckpt)
