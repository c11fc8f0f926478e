"""Does DeepSpeedCPUAdam's scalar tail round like its SIMD body? The same 4096 elements stepped as one
tensor (all SIMD body) and as tensors of sizes that leave 1..15-element scalar tails."""

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam


def run(sizes, p0, g_seq):
    ps = [torch.nn.Parameter(t.clone()) for t in torch.split(p0, sizes)]
    opt = DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    for g in g_seq:
        for p, gg in zip(ps, torch.split(g, sizes)):
            p.grad = gg.clone()
        opt.step()
    return torch.cat([p.detach() for p in ps])


torch.manual_seed(0)
n = 4096
p0 = torch.randn(n)
g_seq = [torch.randn(n) * 10 ** torch.empty(n).uniform_(-8, 1) for _ in range(5)]
body = run([n], p0, g_seq)
for sizes in ([1] * n, [15, 1] * (n // 16), [7, 9] * (n // 16), [129, 127] * (n // 256)):
    other = run(sizes, p0, g_seq)
    d = (body - other).abs()
    print(sizes[:2], "differing elements:", int((d > 0).sum()), "max", float(d.max()))
