"""fitone.extensions: DeepSpeed's JIT-built ops, and the build lock an interrupted build leaves behind.

The lock is made as torch makes it (torch.utils.file_baton.FileBaton, what torch's JIT build holds while it
compiles) by a real process that is then killed, and the engine that meets it is a real `fitone train`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_RUN, child_env, run_child
from fitone import extensions


def _holder(lock: Path, hold_s: float) -> subprocess.Popen:
    """A process that takes `lock` as torch's build does and holds it for `hold_s` seconds, then releases it."""
    code = ("import importlib.util, os, sys, time; "  # torch's file_baton.py, loaded without importing torch
            "torch_dir = importlib.util.find_spec('torch').submodule_search_locations[0]; "
            "spec = importlib.util.spec_from_file_location('fb', os.path.join(torch_dir, 'utils', 'file_baton.py')); "
            "fb = importlib.util.module_from_spec(spec); spec.loader.exec_module(fb); b = fb.FileBaton(sys.argv[1]); "
            "assert b.try_acquire(); print('held', flush=True); time.sleep(float(sys.argv[2])); b.release()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock), str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_fitones_native_op_is_built_apart_for_each_cpu(tmp_path, monkeypatch):
    """fitone's fused step builds with -march=native: its folder carries the CPU's instruction-set fingerprint, so
    a cache several machines share never hands one CPU another's build; DeepSpeed's ops keep their names."""
    skylake = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
    older = "processor\t: 0\nflags\t\t: fpu sse2 avx2\n"
    assert extensions.cpu_fingerprint(skylake) != extensions.cpu_fingerprint(older)
    assert extensions.cpu_fingerprint(skylake) == extensions.cpu_fingerprint(skylake.replace("avx2 avx512f",
                                                                                              "avx512f avx2"))
    assert extensions.build_name("cpu_adam") == "cpu_adam"
    name = extensions.build_name("fitone_adam16")
    assert name == f"fitone_adam16_{extensions.cpu_fingerprint()}" and name.isidentifier()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "fitone_adam16").mkdir()
    (tmp_path / "fitone_adam16" / "fitone_adam16.so").write_bytes(b"")  # another CPU's build, or an old one
    assert not extensions.is_built("fitone_adam16")
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert extensions.is_built("fitone_adam16")


def test_an_op_is_built_where_torch_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not extensions.is_built("cpu_adam")
    (tmp_path / "cpu_adam").mkdir()
    assert not extensions.is_built("cpu_adam")  # a folder a build was cut short in
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)  # the layout of torch's default root
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert extensions.is_built("cpu_adam") and not extensions.is_built("deepspeed_shm_comm")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import get_default_build_root

    assert extensions.extensions_root() == Path(get_default_build_root())  # where the quick start built them


def test_a_live_builder_is_waited_for_and_a_killed_ones_lock_is_removed(tmp_path):
    lock = tmp_path / "lock"
    said = []
    live = _holder(lock, 3)
    assert extensions.lock_holders(lock) == [live.pid]
    started = time.monotonic()
    extensions.clear_stale_lock(lock, "DeepSpeed's CPU Adam", said.append, poll_s=0.2)  # returns when it releases
    assert live.wait(timeout=30) == 0 and not lock.exists()
    assert said == [f"waiting for process {live.pid}, which is building DeepSpeed's CPU Adam ({lock})"]
    assert time.monotonic() - started < 30

    killed = _holder(lock, 600)
    killed.kill()
    killed.wait(timeout=30)
    assert lock.exists() and extensions.lock_holders(lock) == []
    said.clear()
    extensions.clear_stale_lock(lock, "DeepSpeed's CPU Adam", said.append)
    assert not lock.exists()
    assert said == [f"removed {lock}, left by an interrupted build of DeepSpeed's CPU Adam (no process holds it)"]


def test_fitone_train_after_an_interrupted_build_clears_the_lock_and_says_what_it_builds(deepspeed_ops_built,
                                                                                         tmp_path):
    """The issue's hang: a build killed mid-way leaves `lock` and no .so, and every later engine waited on it
    silently. Here both folders are copies of the cached builds with a killed builder's lock in each, and
    shm_comm's build was cut before its link (its objects are there, its .so is not: the link alone is
    redone, in seconds): the run clears both locks in one line each, says that it builds shm_comm before it
    does (DeepSpeed's process group setup builds it silently), builds it, and trains."""
    root = tmp_path / "torch_extensions"
    for name in extensions.OPS:  # copy2 keeps the times: ninja sees what was built as up to date
        shutil.copytree(extensions.build_dirs(name)[0], root / extensions.build_name(name))
    for so in (root / "deepspeed_shm_comm").glob("*.so"):
        so.unlink()
    for name in map(extensions.build_name, extensions.OPS):
        killed = _holder(root / name / "lock", 600)
        killed.kill()
        killed.wait(timeout=30)
        assert (root / name / "lock").exists()
    env = {**child_env(), "TORCH_EXTENSIONS_DIR": str(root)}
    started = time.monotonic()
    try:
        run = run_child([sys.executable, "-m", "fitone", "train", *CLI_RUN, "--max-steps", "2"], env=env,
                        timeout=540)  # without the fix: no output, forever
    except subprocess.TimeoutExpired:
        pytest.fail("fitone train waited on a build lock whose builder was killed")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("fitone: ")]
    shm, adam = root / "deepspeed_shm_comm" / "lock", root / "cpu_adam" / "lock"
    removed_shm = f"fitone: removed {shm}, left by an interrupted build of {extensions.OPS['deepspeed_shm_comm']}"
    building_shm = f"fitone: building {extensions.OPS['deepspeed_shm_comm']} once for this machine"
    removed_adam = f"fitone: removed {adam}, left by an interrupted build of {extensions.OPS['cpu_adam']}"
    order = [next(i for i, line in enumerate(lines) if line.startswith(start))
             for start in (removed_shm, building_shm, removed_adam)]
    assert order == sorted(order), lines
    assert not any("building DeepSpeed's CPU Adam" in line for line in lines)  # the copy is a complete build
    assert any((root / "deepspeed_shm_comm").glob("*.so"))  # built, in the folder the lock was cleared from
    assert not shm.exists() and not adam.exists()
    assert time.monotonic() - started < 540
