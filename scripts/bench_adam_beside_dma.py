"""Whether the host's memory has room for GPU copies beside CPU Adam: the CPU Adam op's rate alone, the page-locked
host<->GPU copies' rate alone (both directions at once), then both at once. If the copies barely slow the Adam, a
share of a clipped step's Adam can go to the GPU (states up, step, states down) in the time the CPU spends on the rest.

    python scripts/bench_adam_beside_dma.py --elements 1073741824 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def adam_s(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int) -> float:
    t0 = time.perf_counter()
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=1e-5, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    return time.perf_counter() - t0


def copies(stop: threading.Event, up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
           moved: list[float]) -> None:
    """H2D and D2H on two streams, in rounds, until `stop`; appends (bytes up, bytes down, seconds)."""
    s_up, s_down = torch.cuda.Stream(), torch.cuda.Stream()
    t0 = time.perf_counter()
    rounds = 0
    while not stop.is_set():
        with torch.cuda.stream(s_up):
            up[1].copy_(up[0], non_blocking=True)
        with torch.cuda.stream(s_down):
            down[1].copy_(down[0], non_blocking=True)
        s_up.synchronize()
        s_down.synchronize()
        rounds += 1
    dt = time.perf_counter() - t0
    moved.extend([rounds * up[0].numel() * up[0].element_size() / dt / 1e9,
                  rounds * down[0].numel() * down[0].element_size() / dt / 1e9, dt])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=2**30)
    ap.add_argument("--copy-elements", type=int, default=2**28)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    n = a.elements
    p, m, v = (torch.rand(n) for _ in range(3))
    g = torch.randn(n)
    host_up = torch.rand(a.copy_elements).pin_memory()
    host_down = torch.empty(a.copy_elements).pin_memory()
    dev_up, dev_down = torch.empty(a.copy_elements, device="cuda"), torch.rand(a.copy_elements, device="cuda")
    out: dict = {"threads": torch.get_num_threads(), "elements": n, "gpu": torch.cuda.get_device_name()}
    adam_s(p, m, v, g, 1)  # warm
    out["adam_alone_s_per_1e9"] = statistics.median(adam_s(p, m, v, g, 2 + k) for k in range(a.reps)) / n * 1e9
    for label, run_adam in (("copies_alone", False), ("beside_adam", True)):
        stop, moved = threading.Event(), []
        th = threading.Thread(target=copies, args=(stop, (host_up, dev_up), (dev_down, host_down), moved))
        th.start()
        if run_adam:
            out["adam_beside_copies_s_per_1e9"] = statistics.median(
                adam_s(p, m, v, g, 10 + k) for k in range(a.reps)) / n * 1e9
        else:
            time.sleep(3.0)
        stop.set()
        th.join()
        out[f"{label}_up_GBps"], out[f"{label}_down_GBps"] = round(moved[0], 1), round(moved[1], 1)
    # host bytes per element of fused AdamW on fp32 gradients: reads p, m, v, g; writes p, m, v (no scale: g unwritten)
    out["adam_alone_GBps"] = round(28 / out["adam_alone_s_per_1e9"], 1)
    out["adam_beside_copies_GBps"] = round(28 / out["adam_beside_copies_s_per_1e9"], 1)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
