"""The exact fp32 pass (fitone.zero2.adam32) against today's widening + PyTorch's fused AdamW, on this host alone:
32M-element chunks as the pipelined update runs them, 4 chunks, bf16 gradients, scale 1024 (no GPU involved)."""
import subprocess, time, threading
import torch
from fitone import extensions
from fitone.zero2 import adam32

import os
CH, N = 2**int(os.environ.get("LOG2", 25)), 4
print("torch", torch.__version__, "capability", torch.backends.cpu.get_cpu_capability(), "threads", torch.get_num_threads(),
      "parallel:", torch.__config__.parallel_info().splitlines()[:6])
ms = [torch.randn(CH) for _ in range(N)]; m1 = [torch.zeros(CH) for _ in range(N)]; m2 = [torch.zeros(CH) for _ in range(N)]
gs = [torch.randn(CH).bfloat16() for _ in range(N)]; scratch = torch.empty(CH)
hy = dict(step=3, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad_scale=1024.0)
adam32.available()
mod = extensions.load_native(adam32.OP, adam32._SOURCE)
print("op file", mod.__file__); print(subprocess.run(["ldd", mod.__file__], capture_output=True, text=True).stdout)

def op():
    for i in range(N): adam32.adamw(ms[i], m1[i], m2[i], gs[i], **hy)
def widen():
    for i in range(N):
        scratch.copy_(gs[i]); adam32.torch_adamw(ms[i], m1[i], m2[i], scratch, **hy)
def timed(fn, where="main"):
    best = []
    for _ in range(3):
        t = time.perf_counter()
        if where == "main": fn()
        else:
            th = threading.Thread(target=fn); th.start(); th.join()
        best.append(time.perf_counter() - t)
    return min(best)
for name, fn in (("op", op), ("widen+torch", widen)):
    for where in ("main", "thread"):
        s = timed(fn, where)
        print(f"{name:12s} {where:6s}: {s:.3f} s for {N*CH/1e9:.3f}e9 elements = {s/(N*CH/1e9):.3f} s per 1e9", flush=True)
for t in (16, 8, 4):
    torch.set_num_threads(t)
    print(f"set_num_threads({t}): op {timed(op):.3f} s, widen+torch {timed(widen):.3f} s", flush=True)
