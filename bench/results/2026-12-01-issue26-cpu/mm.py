"""Item 8: which SIMD switches reach a matmul (fp32: mm.py; bf16: mm2.py): a hash of the result bits."""

import torch
import hashlib

torch.manual_seed(0)
a, b = torch.randn(333, 517), torch.randn(517, 271)
x = torch.randn(8, 64, 30, 30)
w = torch.randn(64, 64, 3, 3)
print(
    hashlib.md5((a @ b).numpy().tobytes()).hexdigest()[:8],
    hashlib.md5(torch.nn.functional.conv2d(x, w).numpy().tobytes()).hexdigest()[:8],
    hashlib.md5(torch.softmax(a, -1).numpy().tobytes()).hexdigest()[:8],
)
