# The one-pass redo (adam32.redo_adamw) against one Adam pass (adam32.adamw), 2^25 elements, bf16 gradient, best of 20.
# Run from the repository root: PYTHONPATH=. python3 bench/results/2026-12-06b-cpu/redo_speed.py
import time, torch
from fitone.zero2 import adam32
torch.manual_seed(0)
n = 1 << 25
p, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
g = (torch.randn(n) * 1e-3).to(torch.bfloat16)
h = dict(step=5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adam_w_mode=True)
adam32.adamw(p, m, v, g, grad_scale=2.0, **h)
def best(f, k=20):
    t = []
    for _ in range(k):
        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)
    return min(t)
a = best(lambda: adam32.adamw(p, m, v, g, grad_scale=2.0, **h))
r = best(lambda: adam32.redo_adamw(p, m, v, g, grad_scale=2.0, old_grad_scale=2.0, **h))
print(f"threads {torch.get_num_threads()} adamw {a:.4f} s redo {r:.4f} s ratio {r/a:.2f}")
