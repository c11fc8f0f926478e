"""The run directory's policy: refuse to touch an existing run unless asked, find what to resume, and set
the directory up (config.json, metrics) once the run is about to start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from fitone import checkpoint
from fitone.errors import RunDirError
from fitone.metrics import MetricsLog, open_sinks
from fitone.units import gib


def check_run_dir(out: str | None, *, resume: bool, overwrite: bool, model: str) -> Path | None:
    """The checkpoint to resume from (None: start fresh), or a RunDirError. Nothing is written yet."""
    if out is None:
        if resume:
            raise RunDirError("--resume needs --out: the run directory to continue")
        return None
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path} is a file: give a directory path")
    if resume:
        ckpt = checkpoint.latest(path)
        if ckpt is None:
            raise RunDirError(f"nothing to resume in {path}: no complete checkpoint (train with --save-every N "
                              "to write them), or drop --resume to start fresh")
        saved_model = checkpoint.read_state(ckpt).get("model")
        if saved_model not in (None, model):
            raise RunDirError(f"{ckpt} is a checkpoint of model {saved_model!r}, not {model!r}: resume with "
                              f"--model {saved_model} or use another --out")
        return ckpt
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise RunDirError(f"--out {path} already holds a run: add --resume to continue it, --overwrite to "
                              "replace it, or choose another directory")
        if not is_run_dir(path):  # --overwrite deletes the folder: never one that fitone did not write
            raise RunDirError(f"--out {path} holds files that are not a fitone run, and --overwrite would delete "
                              "them: choose a new or empty directory")
    return None


def free_disk_bytes(path: Path) -> int:
    """Bytes this user can still write on the filesystem that holds `path` (or would, once created)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def stop_save_short(out: Path, checkpoint_bytes: int) -> str | None:
    """Why a checkpoint of `checkpoint_bytes` would not fit the disk under `out` now (None: it fits): a stop's
    save (Ctrl-C, SIGTERM, the host guard) comes at any step, where --save-every's check counted only its own."""
    free = free_disk_bytes(out)
    if checkpoint_bytes <= free:
        return None
    return (f"one checkpoint of this model is {gib(checkpoint_bytes):.2f} GiB and {out} has {gib(free):.2f} GiB free "
            "(a half-written checkpoint resumes nothing); free disk space, or give an --out on a larger disk")


def check_checkpoint_room(out: Path, *, checkpoint_bytes: int, keep: int, save_every: int, overwrite: bool,
                          saves: int | None = None) -> None:
    """Refuse --save-every where the disk under --out cannot hold the checkpoints the run keeps plus the one it
    is writing: a save is complete on disk before the oldest is pruned, so the disk holds keep + 1 at its peak,
    or fewer where the run writes fewer (`saves`, when its length is known). A resumed run's own checkpoints
    already on the disk count toward those; --overwrite deletes them first."""
    held = [] if overwrite else checkpoint.complete_checkpoints(out)
    held_bytes = sum(f.stat().st_size for c in held for f in c.rglob("*") if f.is_file())
    at_peak = max(keep, len(held)) + 1 if saves is None else min(max(keep, len(held)) + 1, len(held) + saves)
    peak = at_peak * checkpoint_bytes
    room = free_disk_bytes(out)
    if peak - held_bytes > room:
        raise RunDirError(
            f"--save-every {save_every}: one checkpoint of this model is {gib(checkpoint_bytes):.2f} GiB, and with "
            f"--keep-checkpoints {keep} the disk holds {at_peak} at once (the newest is written before the oldest "
            f"goes): {gib(peak):.2f} GiB{f' ({gib(held_bytes):.2f} of it already there)' if held else ''}, but "
            f"{out} has {gib(room):.2f} GiB free; free disk space, lower --keep-checkpoints, or give an --out on a "
            "larger disk (--no-preflight skips this check)")


def setup_run_dir(out: Path, *, overwrite: bool, settings: dict[str, Any], report_sinks: list[str],
                  resume_step: int, verbose: bool = False) -> MetricsLog:
    """Create (or, with `overwrite`, replace) the run directory, drop a killed save's leftovers, write
    config.json and open the metrics log; on rank 0 only. check_run_dir has passed."""
    if overwrite and out.exists():
        shutil.rmtree(out)  # check_run_dir made sure it is a run directory
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.remove_partial(out)
    (out / "config.json").write_text(json.dumps(settings, indent=2, default=str))
    return MetricsLog(out / "metrics.jsonl", resume_step=resume_step,
                      sinks=open_sinks(report_sinks, out, settings, resume_step=resume_step, verbose=verbose))


def is_run_dir(path: Path) -> bool:
    """A directory fitone wrote: metrics, checkpoints, or its config.json (not a model's config.json)."""
    if (path / "metrics.jsonl").is_file() or checkpoint.checkpoint_root(path).is_dir():
        return True
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"max_bad_steps", "save_every", "host_mem_stop"} <= saved.keys()
