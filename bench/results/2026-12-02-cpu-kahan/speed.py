"""The fused 16-bit step alone, by rounding: median of 5 steps (after one warm-up) over 2**25 elements from
bf16 gradients, one thread. Run from the repository root with the checkout first on PYTHONPATH."""

import statistics
import time

import torch

from fitone.zero2.low_precision import NEAREST, STOCHASTIC, RandomBits, fused_adamw_16bit

torch.set_num_threads(1)
n = 2**25
g = torch.Generator().manual_seed(0)
master = torch.randn(n, generator=g).bfloat16()
m, v = (master * 1e-2).clone(), (master.abs() * 1e-4).clone()
grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
comp = torch.zeros_like(master)
bits = RandomBits(0)
for name, kw in (("nearest", dict(rounding=NEAREST)), ("stochastic", dict(rounding=STOCHASTIC, bits=bits)),
                 ("kahan", dict(compensation=comp))):
    times = []
    for step in range(1, 7):
        t0 = time.perf_counter()
        fused_adamw_16bit(master, m, v, grad, step=step, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                          **kw)
        times.append(time.perf_counter() - t0)
    print(f"{name}: median of 5 steps {statistics.median(times[1:]):.4f} s over {n} elements, one thread")
