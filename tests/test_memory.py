"""fitone.memory: freed host heap goes back to the OS; one host-RAM reading, the container's where it binds,
for the host-memory watch and the plan alike."""

import subprocess
import sys

import pytest

from fitone import memory
from fitone.units import GIB

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


def test_the_used_fraction_and_the_room_left_are_the_containers_where_its_limit_binds(fake_cgroup):
    """FAKED: the cgroup files (fake_cgroup). A container's OOM killer acts at its limit, whatever the machine
    has free: the host-memory watch reads the fraction of the limit used, the plan and pre-flight the room left."""
    machine = memory.psutil.virtual_memory()
    limit = min(machine.total // 2, 8 * GIB)
    fake_cgroup(limit, int(0.97 * limit))
    assert memory.host_used_fraction() == pytest.approx(0.97, abs=1e-6) or machine.percent / 100 > 0.97
    assert memory.host_available_bytes() == min(machine.available, limit - int(0.97 * limit))
    fake_cgroup(limit, limit // 10)  # the machine's own figures where they are the tighter ones
    assert memory.host_used_fraction() == pytest.approx(max(memory.psutil.virtual_memory().percent / 100, 0.1),
                                                        abs=0.02)


def test_the_plan_counts_the_host_ram_the_container_leaves(fake_cgroup):
    """FAKED: the cgroup files. `fitone plan` (and so the pre-flight, the same function) compares its host
    total with this process's RSS plus what the container leaves, not with the machine's free memory."""
    import fitone

    limit = min(memory.psutil.virtual_memory().total // 2, 8 * GIB)
    fake_cgroup(limit, limit - GIB)
    p = fitone.plan(model="t5-tiny", from_scratch=True, gpu_mem="8GiB", device="cpu")
    assert abs(p.host_available - (GIB + memory.host_rss_bytes())) < 256 * 2**20
