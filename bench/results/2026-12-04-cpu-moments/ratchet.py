"""Adam's second moment held in bf16: does it decay? 100,000 elements, beta2 = 0.999, 1,000 steps of squared
gradients drawn Exponential with a mean falling linearly from 1 to 0.1; v kept in fp32, in bf16 rounded to the
nearest (what bf16-nearest and bf16-kahan do to the moments) and in bf16 rounded stochastically (what bf16 does).

    python bench/results/2026-12-04-cpu-moments/ratchet.py
"""
import torch

torch.manual_seed(0)
n, steps, b2 = 100_000, 1_000, 0.999
v32 = torch.ones(n)
vn = torch.ones(n, dtype=torch.bfloat16)
vs = torch.ones(n, dtype=torch.bfloat16)


def stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, up with the probability of the remainder (positive x)."""
    bits = x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    return (bits & ~0xFFFF).view(torch.float32).bfloat16()


for t in range(steps):
    g2 = torch.empty(n).exponential_() * (1.0 - 0.9 * t / steps)
    v32 = v32 * b2 + g2 * (1 - b2)
    vn = (vn.float() * b2 + g2 * (1 - b2)).bfloat16()
    vs = stochastic(vs.float() * b2 + g2 * (1 - b2))
print(f"after {steps} steps, E[g^2] now 0.1: v fp32 {v32.mean():.4f}, bf16 nearest {vn.float().mean():.4f}, "
      f"bf16 stochastic {vs.float().mean():.4f}; bf16(1.0 * 0.999) = {torch.tensor(0.999).bfloat16().item()}")
