"""The saved probe results: their key, their files, reading and saving them.

Results are saved under ~/.cache/fitone/probes/ (or $FITONE_CACHE_DIR/probes/), keyed by everything that
decides memory, so `fitone train --batch-size auto` reuses a probe instead of repeating it. A capped probe
(no size ran out of memory before max_batch) did not find the card's limit: it is saved under its own key
and never reused by --batch-size auto. The choice made after the search (fitone.probe.choice) is kept with
the search settings: a throughput choice is reused only for the same samples per GPU step (api.choice_key).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

import fitone
from fitone import loss as fused_loss
from fitone import memory
from fitone.config import TrainConfig
from fitone.models import CAUSAL
from fitone.probe.results import ProbeResult
from fitone.probe.trial import NAMED_SOURCES
from fitone.run import Run
from fitone.zero2 import installed_version, step_mode, upload


def cache_dir() -> Path:
    """~/.cache/fitone/probes, or $FITONE_CACHE_DIR/probes."""
    root = os.environ.get("FITONE_CACHE_DIR") or Path.home() / ".cache" / "fitone"
    return Path(root) / "probes"


def probe_key(run: Run) -> dict[str, Any]:
    """Everything that decides how much memory a step takes (the weights' values do not), from the resolved
    run; the key holds the step a one-GPU probe of it runs.

    Not in it, because a trial's memory does not depend on them: the seed, lr and schedule, the run's length,
    and the accumulation (a probe runs every step as an optimizer step; DeepSpeed's GPU buffer for
    accumulating is allocated at init whatever the accumulation, stage_1_and_2.py line 659)."""
    import transformers

    cfg, config, device, precision = run.settings, run.model_config, run.device, run.precision
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    lengths = ({"seq_len": cfg.seq_len} if run.task == CAUSAL
               else {"src_len": cfg.src_len, "tgt_len": cfg.tgt_len})
    key: dict[str, Any] = {
        "model_config": _digest(json.dumps(values, sort_keys=True, default=str)),
        "precision": precision, "activation_checkpointing": cfg.activation_checkpointing,
        "offload": cfg.offload, **lengths, "data": _data_key(cfg),
        "fused_loss": fused_loss.fused_loss_backend(config, device=device, precision=precision)
        if cfg.fused_loss else None,
        "ds_config": _digest(Path(cfg.ds_config).read_bytes()) if cfg.ds_config else None,
        "device": device, "gpu": memory.gpu_name(), "max_gpu_memory_bytes": run.cap_bytes,
        # what the allocator runs with: a user's PYTORCH_CUDA_ALLOC_CONF overrides --[no-]expandable-segments
        "allocator": memory.allocator_settings(cfg.expandable_segments) if device == "cuda" else None,
        "world_size": 1, "fitone": fitone.__version__, "deepspeed": installed_version(),
        # the allocator and kernels (torch) and the models' code (transformers) decide activation memory too
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if run.mode.on_one_gpu().name == step_mode.PIPELINED:
        # its landing chunks take GPU memory (the delayed update's extra is on the host), unless the cast is made on
        # the host (fitone.zero2.upload), which a probe from before it did not know
        master, weights = (4 if run.mode.states == "fp32" else 2), (4 if precision == "fp32" else 2)
        key["pipelined_update"] = "cast on the host" if upload.casts_on_host(master, weights) else True
    if run.mode.states != "fp32":
        key["optimizer_states"] = run.mode.states  # 16-bit masters land in 16-bit chunks: less GPU than the exact mode
    return key


def _data_key(cfg: TrainConfig) -> Any:
    """What the worst-case batch is made of: full rows, the maximum lengths, or a data source's longest
    examples as the model's tokenizer cuts them (so the source's files and the tokenizer's files count)."""
    if cfg.pack:  # full rows whatever the data (a seq2seq model refuses --pack before this)
        return "packed rows"
    if cfg.data in NAMED_SOURCES:
        return "maximum lengths"
    return {"source": _files_key(cfg.data), "split": cfg.data_split, "config": cfg.data_config,
            "fields": [cfg.source_field, cfg.target_field, cfg.text_field, cfg.prompt_field],
            "tokenizer": {"model": cfg.model, "from_scratch": cfg.from_scratch, "files": _files_key(cfg.model)},
            **({"chat_template": _digest(Path(cfg.chat_template).read_bytes())} if cfg.chat_template else {})}


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")  # values, not sizes


def _files_key(spec: str) -> Any:
    """A local file, directory or glob as its files' names, sizes and mtimes (an edit re-measures); else the
    name (a hub id)."""
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(str(path), recursive=True))]
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.endswith(_WEIGHT_FILES))
    elif path.is_file():
        files = [path]
    else:
        return spec
    stats = [(f, f.stat()) for f in files if f.is_file()]
    return {"path": str(path.resolve()), "files": [[str(f.resolve()), st.st_size, st.st_mtime_ns] for f, st in stats]}


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def cache_path(key: dict[str, Any]) -> Path:
    return cache_dir() / f"{_digest(json.dumps(key, sort_keys=True))}.json"


def capped_key(key: dict[str, Any]) -> dict[str, Any]:
    """Where a capped probe is saved: beside, never over, a full probe of the same settings."""
    return {**key, "capped": True}


def read_cached(key: dict[str, Any], search: dict[str, Any] | None = None, *, full_only: bool = False,
                choice: dict[str, Any] | None = None) -> ProbeResult | None:
    """The saved result for `key` (and these search settings, when given); None if there is none.
    `full_only`: None for a capped probe too (one saved before capped probes had their own key).
    `choice`: only a result whose search settings hold these (api.choice_key: how it chose); the largest
    micro-batch is chosen again from any saved search, untimed, so {"prefer": "largest"} takes any."""
    path = cache_path(key)
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != key or (search is not None and entry["search"] != search):
            return None
        if choice is not None and choice != {"prefer": "largest"} and any(
                entry["search"].get(k) != v for k, v in choice.items()):
            return None
        result = ProbeResult.from_dict(entry["result"])
        if full_only and result.meta.get("capped", all(t.fits for t in result.trials)
                                          and result.largest_fit >= entry["search"].get("max_batch", 0)):
            return None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or from another layout: measure again, and overwrite it
    result.meta["cache_file"] = str(path)
    return result


def save_cached(key: dict[str, Any], search: dict[str, Any], result: ProbeResult) -> Path:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"key": key, "search": search, "result": result.to_dict()}, indent=2) + "\n")
    tmp.replace(path)
    return path
