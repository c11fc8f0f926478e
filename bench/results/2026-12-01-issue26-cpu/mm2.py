"""Item 8: which SIMD switches reach a matmul (fp32: mm.py; bf16: mm2.py): a hash of the result bits."""

import torch
import hashlib

torch.manual_seed(0)
a, b = torch.randn(333, 517).bfloat16(), torch.randn(517, 271).bfloat16()
print(
    hashlib.md5((a @ b).float().numpy().tobytes()).hexdigest()[:8],
    hashlib.md5(torch.nn.functional.linear(a, b.T).float().numpy().tobytes()).hexdigest()[:8],
)
