"""scripts/gpu_memory_peak.py's replay of an allocator trace. torch records a trace on CUDA only, so the trace here
is written by hand in the snapshot's format (`torch.cuda.memory._snapshot()["device_traces"]`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
MIB = 2**20


def _load():
    spec = importlib.util.spec_from_file_location("gpu_memory_peak", ROOT / "scripts" / "gpu_memory_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frames(*where: str) -> list[dict]:
    return [{"filename": f, "line": 10 * i, "name": f"f{i}"} for i, f in enumerate(where)]


def _trace() -> list[dict]:
    head = _frames("/x/torch/nn/functional.py", "/w/main/fitone/loss.py", "/w/main/fitone/train.py")
    embed = _frames("/x/torch/autograd/graph.py", "/x/site-packages/deepspeed/runtime/engine.py")
    return [
        {"action": "alloc", "addr": 1, "size": 100 * MIB, "frames": head},     # 100
        {"action": "alloc", "addr": 2, "size": 50 * MIB, "frames": embed},     # 150
        {"action": "free_requested", "addr": 1, "size": 100 * MIB},           # 50
        {"action": "free_completed", "addr": 1, "size": 100 * MIB},           # 50 (counted once)
        {"action": "alloc", "addr": 3, "size": 120 * MIB, "frames": head},     # 170: the peak
        {"action": "alloc", "addr": 4, "size": 1 * MIB, "frames": embed},      # 171
        {"action": "free_completed", "addr": 3, "size": 120 * MIB},           # 51: no request recorded
        {"action": "free_completed", "addr": 4, "size": 1 * MIB},             # 50
    ]


def test_the_replay_finds_the_highest_total_and_what_was_alive_then():
    peak = _load()
    best, at, live = peak.live_at_peak(_trace())
    assert best == 171 * MIB and at == 5
    assert sorted(live) == [2, 3, 4]


def test_the_report_groups_the_live_blocks_by_their_owning_frame():
    peak = _load()
    text = peak.report(_trace(), floor=16 * MIB)
    assert "peak allocated (trace replay): 0.167 GiB at event 5 of 8" in text
    lines = text.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("alive then"))
    assert "fitone/loss.py:10 f1" in lines[first + 1] and "(120 MiB)" in lines[first + 1]
    assert "deepspeed/runtime/engine.py" not in lines[first + 1]
    assert "torch/autograd/graph.py:0 f0" in lines[first + 2] and "(50 MiB)" in lines[first + 2]
    assert "0.001 GiB in smaller ones" in lines[first]
