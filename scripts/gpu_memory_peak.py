"""What holds the GPU at a run's peak: one `bench_train.py` run (a fitone command in this process, no export) under
torch's memory history, then the allocator's trace replayed to its highest allocated total. Writes
`$OUT/<tag>-peak.txt`: that total, the allocation that reached it, and the blocks alive then, grouped by the
innermost fitone / DeepSpeed / transformers frame that made them; `--keep-snapshot` also writes the snapshot
(`$OUT/<tag>.pickle`, for https://pytorch.org/memory_viz).

    python scripts/gpu_memory_peak.py TAG [--keep-snapshot] -- train --recipe qwen3-8b/24gb model=qwen3-8b \
        from_scratch=true data=synthetic batch_size=2 global_batch=6 max_steps=2 out=/tmp/run --overwrite
"""

from __future__ import annotations

import os
import pickle
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from _harness import GIB  # and the checkout first on the path

MIB = 2**20
OWNERS = ("fitone/", "deepspeed/", "transformers/", "liger_kernel/", "torch/autograd/", "torch/utils/checkpoint")
MAX_ENTRIES = 2_000_000


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """(peak allocated bytes, index of the event that reached it, the blocks alive then by address), replaying a
    device trace from `torch.cuda.memory._snapshot()`. A block counts from its `alloc` until its
    `free_requested` (when the allocator's allocated-bytes statistic drops), or its `free_completed` where no
    request was recorded."""
    def replay(stop: int | None) -> tuple[int, int, dict[int, dict[str, Any]]]:
        live: dict[int, dict[str, Any]] = {}
        total = best = 0
        best_at = -1
        for i, e in enumerate(events if stop is None else events[:stop + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
            elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
            if total > best:
                best, best_at = total, i
        return best, best_at, live

    best, best_at, _ = replay(None)
    return best, best_at, replay(best_at)[2] if best_at >= 0 else {}


def owner(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in fitone, DeepSpeed, transformers or autograd, as 'file:line name'."""
    for f in frames:
        name = f.get("filename", "")
        if any(o in name for o in OWNERS):
            short = name.split("site-packages/")[-1].split("/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no owning frame)" if not frames else f"{frames[0].get('filename')}:{frames[0].get('line')}"


def report(events: list[dict[str, Any]], floor: int = 16 * MIB) -> str:
    """The peak and its live blocks of `floor` bytes or more, largest group first, as text."""
    best, best_at, live = live_at_peak(events)
    lines = [f"peak allocated (trace replay): {best / GIB:.3f} GiB at event {best_at} of {len(events)}"]
    if best_at >= 0:
        e = events[best_at]
        lines.append(f"reached by a {e['size'] / MIB:.1f} MiB allocation made at {owner(e.get('frames', []))}")
        lines += ["    " + f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in e.get("frames", [])[:12]]
    groups: dict[str, list[int]] = defaultdict(list)
    for block in live.values():
        groups[owner(block.get("frames", []))].append(block["size"])
    small = sum(s for sizes in groups.values() for s in sizes if s < floor)
    lines.append(f"alive then, by owner (blocks of {floor // MIB} MiB or more; {small / GIB:.3f} GiB in smaller ones):")
    for key, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        big = sorted((s for s in sizes if s >= floor), reverse=True)
        if big:
            shown = ", ".join(f"{s / MIB:.0f}" for s in big[:8]) + (" ..." if len(big) > 8 else "")
            lines.append(f"  {sum(big) / GIB:7.3f} GiB  {len(big):4d} blocks ({shown} MiB)  {key}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import torch

    import bench_train

    tag, keep = argv[0], "--keep-snapshot" in argv[:argv.index("--")]
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    try:
        code = bench_train.main([tag, "--no-export", *argv[argv.index("--"):]])
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    out = Path(os.environ.get("OUT", "."))
    if keep:
        with open(out / f"{tag}.pickle", "wb") as f:
            pickle.dump(snapshot, f)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    text = report(events)
    if len(events) >= MAX_ENTRIES:
        text = f"the trace holds its last {MAX_ENTRIES} events only: earlier blocks are missing\n" + text
    steps_peak = torch.cuda.max_memory_allocated() / GIB
    text += f"torch.cuda.max_memory_allocated since the steps began: {steps_peak:.3f} GiB\n"
    (out / f"{tag}-peak.txt").write_text(text)
    print(text, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
