"""Runtime and engine helpers that need no engine: the in-process distributed env (the JIT-build checks:
tests/test_extensions.py)."""

import os

import pytest

from fitone.config import TrainConfig
from fitone.runtime import ensure_dist_env, resolve_device
from fitone.errors import DeviceError


def test_launcher_env_is_kept_and_a_single_process_gets_one(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    info = ensure_dist_env()
    assert (info.rank, info.local_rank, info.world_size) == (0, 0, 1) and info.is_main

    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = ensure_dist_env()
    assert (info.rank, info.local_rank, info.world_size) == (3, 1, 4) and not info.is_main


def test_fp16_and_gpu_cap_are_refused_on_the_cpu():
    with pytest.raises(DeviceError, match="bf16 or fp32"):
        resolve_device(TrainConfig(device="cpu", precision="fp16"))
    with pytest.raises(DeviceError, match="--max-gpu-memory"):
        resolve_device(TrainConfig(device="cpu", precision="fp32", max_gpu_memory="8GiB"))


def test_torchrun_single_thread_default_is_replaced_by_a_share_of_the_cores(monkeypatch):
    import torch

    from fitone.runtime import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    try:
        # torchrun's default: OMP_NUM_THREADS=1 for each of 2 local ranks -> 16 threads each
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert "16 CPU threads per rank" in share_cpu_threads()
        assert os.environ["OMP_NUM_THREADS"] == "16" and torch.get_num_threads() == 16
        # a value the user chose is kept
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        assert share_cpu_threads() == "" and os.environ["OMP_NUM_THREADS"] == "4"
        # no torchrun: nothing changes
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert share_cpu_threads() == "" and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_expandable_segments_are_switched_on_unless_the_user_configured_the_allocator(monkeypatch):
    """The CPU has no CUDA allocator: the torch setter is replaced by a recorder (said here)."""
    import torch

    from fitone import memory

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert memory.use_expandable_segments(True) and calls == ["expandable_segments:True"]
    assert not memory.use_expandable_segments(False) and len(calls) == 1
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not memory.use_expandable_segments(True) and len(calls) == 1  # the user's setting wins
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert memory.use_expandable_segments(False) and len(calls) == 1


def _three_steps(timed: bool, phases: bool = True, profile=None, **engine_options):
    """(losses, weights, timers, callbacks seen) of three steps of the tiny engine, with the timing hook or without."""
    import contextlib

    from conftest import fixed_batch, tiny_engine, weights
    from fitone.zero2.timing import timed_engines

    built: list = []
    hook = timed_engines(phases=phases, detail_from=2, on_start=lambda: built.append("start"),
                         on_built=built.append, profile=profile) if timed else contextlib.nullcontext([])
    with hook as timers:
        engine = tiny_engine(**engine_options)
        try:
            losses = []
            for step in range(1, 4):
                loss = engine.forward(fixed_batch(step))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            engine.sync_weights()
            got = weights(engine)
        finally:
            engine.close()
    return losses, got, timers, built, engine


def test_the_phase_timer_reports_each_phase_and_training_is_bit_identical_with_it_on():
    """zero2.timing.timed_engines on a real ZeRO-2 step: each optimizer step's forward, backward and optimizer
    times, ZeRO-2's parts from the detail step on (CPU Adam really ran there), and the same bits as untimed."""
    import torch

    plain_losses, plain, none, _, untimed = _three_steps(timed=False)
    assert untimed.timer is None and none == []
    losses, got, timers, built, engine = _three_steps(timed=True)
    assert losses == plain_losses and got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in got)
    (timer,) = timers
    assert built == ["start", engine] and engine.timer is timer and timer.applied == [True, True, True]
    assert len(timer.steps) == 3
    for step in timer.steps:
        assert all(step[k] > 0 for k in ("forward_s", "backward_s", "optimizer_s")), step
    assert not any(k in step for step in timer.steps[:2] for k in ("cpu_adam_s", "grad_transfer_s"))
    detail = timer.steps[2]
    assert detail["cpu_adam_s"] > 0 and detail["grad_transfer_s"] > 0 and detail["backward_compute_s"] >= 0
    assert detail["cpu_adam_s"] + detail["param_upload_s"] <= detail["optimizer_s"]
    # the callbacks alone: no timer, so no syncs
    losses, got, timers, built, engine = _three_steps(timed=True, phases=False)
    assert timers == [] and engine.timer is None and built == ["start", engine] and losses == plain_losses


def test_the_phase_timer_keeps_an_overlapped_updates_counters_once_each():
    """The pipelined update's CPU work runs beside the next step: its own counters come with the step in which
    it completed, and the weights match the untimed run's."""
    import torch

    plain_losses, plain, *_ = _three_steps(timed=False, pipelined=True)
    losses, got, (timer,), _, _ = _three_steps(timed=True, pipelined=True)
    assert losses == plain_losses and got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in got)
    updates = [s for s in timer.steps if "update_cpu_adam_s" in s]
    assert updates, timer.steps
    for step in updates:
        assert 0 < step["update_cpu_adam_s"] <= step["update_thread_s"] and step["update_wait_s"] >= 0


def test_the_profile_covers_the_one_step_asked_for_and_writes_its_table_and_trace(tmp_path):
    """timed_engines(profile=(1, prefix)): torch.profiler over the second optimizer step only, its kernel table
    and a gzipped Chrome trace written when that step ends; the weights match the unprofiled run's."""
    import gzip
    import json

    import torch

    _, plain, *_ = _three_steps(timed=True)
    prefix = str(tmp_path / "step1")
    _, got, (timer,), _, _ = _three_steps(timed=True, profile=(1, prefix))
    assert all(torch.equal(got[k], plain[k]) for k in got) and len(timer.steps) == 3
    table = (tmp_path / "step1.table.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    with gzip.open(tmp_path / "step1.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1.table.txt", "step1.trace.json.gz"]
    assert timer._profiler is None and timer._profile_at is None  # closed after the one step; not reopened
