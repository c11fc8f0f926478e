"""DeepSpeedCPUAdam against PyTorch's fused CPU AdamW (what fitone.zero2.overlap uses) on one flat fp32 tensor.

Median of 5 steps after one warm-up step, and the largest weight difference after them.

    python scripts/bench_cpu_adam.py --elements 100000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import _harness  # noqa: F401 - the checkout's fitone first on the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fitone/torch_extensions"))
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = args.elements
    torch.manual_seed(0)
    start, grad = torch.randn(n), torch.randn(n) * 1e-3
    ds_param = torch.nn.Parameter(start.clone())
    ds_param.grad = grad.clone()
    ds = DeepSpeedCPUAdam([ds_param], lr=1e-3, weight_decay=0.01)
    param, m, v, step = start.clone(), torch.zeros(n), torch.zeros(n), torch.tensor(0.0)

    def torch_step() -> None:
        step.add_(1)
        torch._fused_adamw_([param], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    for name, fn in (("DeepSpeedCPUAdam", ds.step), ("torch._fused_adamw_", torch_step)):
        fn()  # warm-up (DeepSpeed's first call also builds or loads its extension)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:22s} {statistics.median(times):.4f} s per step over {n:,} elements "
              f"({torch.get_num_threads()} threads)")
    print(f"largest weight difference after {args.steps + 1} steps: {(ds_param.data - param).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
