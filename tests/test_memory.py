"""fitone.memory: freed host heap goes back to the OS."""

import subprocess
import sys

import pytest

# In a fresh process: a freed 24 MiB mmap raises glibc's mmap threshold, so the 16 MiB blocks that follow come
# from the heap, as a model's layers built on the CPU do; a 1 MiB block kept after each stops glibc from
# trimming the freed ones off the heap's top by itself.
_CHILD = """
import ctypes, psutil, torch
from fitone.memory import trim_heap
try:
    ctypes.CDLL(None).malloc_trim
except AttributeError:
    print("NO-GLIBC"); raise SystemExit
del_me = torch.ones(24 << 20, dtype=torch.uint8); del del_me
blocks, keep = [], []
for _ in range(48):
    blocks.append(torch.ones(16 << 20, dtype=torch.uint8))
    keep.append(torch.ones(1 << 20, dtype=torch.uint8))
del blocks
rss = psutil.Process().memory_info().rss
assert trim_heap()
print((rss - psutil.Process().memory_info().rss) >> 20)
"""


def test_trim_heap_returns_freed_heap_blocks_to_the_os():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True).stdout.split()
    if out[-1] == "NO-GLIBC":
        pytest.skip("the C library has no malloc_trim (not glibc)")
    freed_mib = int(out[-1])
    assert freed_mib >= 512, f"only {freed_mib} MiB of the 768 MiB freed went back to the OS"
