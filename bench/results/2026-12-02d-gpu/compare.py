"""The plan (the current code) beside each probe trial of call2/, as the README's table.

Run from the repository root: `python bench/results/2026-12-02d-gpu/compare.py`.
"""

import json
import re
from pathlib import Path

from fitone import loss
from fitone.plan import plan
from fitone.units import GIB

HERE = Path(__file__).parent / "call2"


def planned(model: str, batch: int, accumulation: int, liger: bool) -> float:
    loss.liger_available = (lambda: True) if liger else (lambda: False)  # as on the GPU machine
    p = plan(model=model, from_scratch=True, seq_len=512, precision="bf16", batch_size=batch,
             grad_accum=accumulation, max_gpu_memory="23GiB", gpu_mem="141GiB", host_mem="125GiB", device="cuda")
    return p.gpu_allocated / GIB


def main() -> None:
    rows: dict[tuple[int, int], dict[str, float]] = {}
    for t in json.loads((HERE / "llama-3.1-8b" / "p.json").read_text())["trials"]:
        if t["fits"]:
            rows.setdefault((t["batch_size"], t["accumulation"]), {})["L"] = t["peak_gpu_bytes"] / GIB
    log = (HERE / "qwen3-8b" / "probe.log").read_text()
    for b, a, g in re.findall(r"^(\d+)(?: x (\d+))? fits: ([\d.]+) GiB peak", log, re.M):
        rows.setdefault((int(b), int(a or 1)), {})["Q"] = float(g)
    print("| micro-batch x accumulation | Llama-3.1-8B (Liger) measured | plan | Qwen3-8B (chunked) measured | plan |")
    for (b, a), r in sorted(rows.items(), key=lambda x: (x[0][1] > 1, x[0])):
        cells = []
        for key, model, liger in (("L", "llama-3.1-8b", True), ("Q", "qwen3-8b", False)):
            if key in r:
                p = planned(model, b, a, liger)
                cells += [f"{r[key]:.2f}", f"{p:.2f} ({p / r[key] - 1:+.1%})"]
            else:
                cells += ["", ""]
        print(f"| {b} x {a} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
