"""fitone.zero2.cpu_adam.adam_update: DeepSpeedCPUAdam's own C++ step (csrc/ds_adam.cpp calls it in DeepSpeed's
loaded library) with the GIL released, so that the pipelined update's thread leaves the main thread free.

Real DeepSpeedCPUAdam instances and the real op. The GIL test takes no timing: with a long switch interval the
main thread can run while the thread is inside the call only if the call released the GIL."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from fitone.zero2 import cpu_adam

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "bias_correction": True}


def _adam(n: int) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(n))], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])


def _states(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4]


@pytest.mark.numeric
def test_the_releasing_call_gives_deepspeeds_bits_step_after_step(deepspeed_ops_built):
    """Two optimizers (each its own bias-correction powers in DeepSpeed's registry) on the same states: one
    stepped by DeepSpeed's binding, one by fitone's; every element equal after each of 4 steps, with a SIMD tail."""
    n = 4096 * 3 + 8 + 5
    theirs, ours = _adam(n), _adam(n)
    assert cpu_adam.releasing_op(ours) is not None  # the binding is really what runs below
    a, b = _states(n, 0), _states(n, 0)
    for step in range(1, 5):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 1e-2
        theirs.ds_opt_adam.adam_update(theirs.opt_id, step, HYPER["lr"], *HYPER["betas"], HYPER["eps"],
                                       HYPER["weight_decay"], True, a[0], grad.clone(), a[1], a[2])
        cpu_adam.adam_update(ours, step, HYPER, b[0], grad.clone(), b[1], b[2])
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    assert not torch.equal(a[0], _states(n, 0)[0])  # the weights did move


def _main_thread_ran_inside_the_call(adam: torch.optim.Optimizer) -> bool:
    """A thread makes three calls of 4M elements; the main thread takes a reading, then sleeps 1 ms, until the
    thread is done. With a 10 s switch interval the thread is never made to give the GIL up: the main thread
    runs during a call only if the call released it."""
    n = 1 << 22
    params, exp_avg, exp_avg_sq = _states(n, 1)
    grad = torch.randn(n) * 1e-2
    calls: list[tuple[float, float]] = []

    def work() -> None:
        for step in range(1, 4):
            start = time.perf_counter()
            cpu_adam.adam_update(adam, step, HYPER, params, grad, exp_avg, exp_avg_sq)
            calls.append((start, time.perf_counter()))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        readings = []
        thread = threading.Thread(target=work)
        thread.start()
        while thread.is_alive():
            readings.append(time.perf_counter())
            time.sleep(0.001)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(calls) == 3
    return any(start < t < end for t in readings for start, end in calls)


def test_a_thread_in_the_call_leaves_the_main_thread_running(deepspeed_ops_built, monkeypatch):
    """What the binding is for: DeepSpeed's own `adam_update` holds the GIL for the whole call (the pipelined
    update's first steps stalled the next forward's launches on it); fitone's lets the main thread run."""
    adam = _adam(16)
    assert cpu_adam.releasing_op(adam) is not None
    assert _main_thread_ran_inside_the_call(adam)
    monkeypatch.setattr(cpu_adam, "ENABLED", False)  # DeepSpeed's own call
    assert cpu_adam.releasing_op(adam) is None
    assert not _main_thread_ran_inside_the_call(adam)


def test_a_library_it_cannot_bind_is_said_once_and_deepspeeds_call_runs(deepspeed_ops_built, monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(cpu_adam.extensions, "_say", said.append)
    for _ in range(2):
        assert cpu_adam._bound("/nonexistent/cpu_adam.so") is None  # RTLD_NOLOAD: never loads a second copy
    assert len(said) == 1 and said[0].startswith(f"could not bind {cpu_adam.extensions.OPS[cpu_adam.OP]}")
    assert "/nonexistent/cpu_adam.so" in said[0]


def test_the_pipelined_updates_first_step_runs_the_releasing_call(monkeypatch):
    """DeepSpeed's arithmetic in the update's thread (the first applied step) goes through the binding."""
    from conftest import fixed_batch, tiny_engine

    used = []
    real = cpu_adam.releasing_op
    monkeypatch.setattr(cpu_adam, "releasing_op", lambda adam: used.append(real(adam)) or used[-1])
    engine = tiny_engine(pipelined=True)
    try:
        for step in (1, 2):
            engine.backward(engine.forward(fixed_batch(step)))
            engine.step()
        engine.sync_weights()
        assert engine.overlap.applied == 2
    finally:
        engine.close()
    assert len(used) > 1 and all(op is not None for op in used)  # built up front, then once per chunk
