"""The watches that stop a run cleanly: signals, NaN/overflow streaks, host RAM, and their advice."""

from __future__ import annotations

import math
import re
import signal

import pytest
from conftest import CLI_RUN, cpu_config, run_main

import fitone
from fitone import checkpoint, memory
from fitone.errors import TrainingAborted
from fitone.guards import BadStepStreak, HostMemoryWatch, StopRequest, numerics_advice
from fitone.zero2.errors import is_loss_scale_collapse


def test_first_signal_asks_to_stop_and_second_exits_at_once():
    """Real signals to this process: the first only sets a flag (the step finishes, a checkpoint is
    written); a second one, of either kind, raises KeyboardInterrupt right where the process is."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_ctrl_c_is_named_in_the_stop_reason():
    with StopRequest() as stop:
        signal.raise_signal(signal.SIGINT)
    assert stop.signal_name == "SIGINT"


def test_bad_step_streak_counts_consecutive_nan_or_skipped_steps():
    streak = BadStepStreak(3)
    assert not streak.update(1.0, applied=True)
    assert not streak.update(float("nan"), applied=True)
    assert not streak.state_is_good  # a NaN loss: its weights must not be checkpointed
    assert not streak.update(2.0, applied=False)  # an fp16 overflow: skipped, but the weights are intact
    assert streak.state_is_good and streak.total_skipped == 1
    assert streak.update(float("inf"), applied=False)  # third bad step in a row
    assert streak.streak == 3 and streak.total_skipped == 2


def test_a_good_step_resets_the_streak():
    streak = BadStepStreak(2)
    streak.update(math.nan, applied=True)
    streak.update(0.5, applied=True)
    assert streak.streak == 0 and streak.state_is_good
    assert not streak.update(math.nan, applied=True)


def test_t5_in_fp16_gets_the_bf16_advice():
    assert numerics_advice("fp16", "t5") == ("T5 was pre-trained in bf16 and overflows in fp16: "
                                             "use --precision bf16 or fp32")
    assert "bf16" in numerics_advice("fp16", "gpt2") and "T5" not in numerics_advice("fp16", "gpt2")
    assert "--lr" in numerics_advice("bf16", "t5") and "T5" not in numerics_advice("bf16", "t5")


def test_loss_scale_collapse_is_recognised_by_deepspeeds_message():
    """fp16 cannot run on the CPU, so DeepSpeed's own exception text stands in for the event."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    with pytest.raises(Exception) as caught:
        scaler.update_scale(True)
    assert is_loss_scale_collapse(caught.value)
    assert not is_loss_scale_collapse(RuntimeError("CUDA out of memory"))


def test_host_memory_watch_warns_once_then_stops():
    readings = iter([0.5, 0.91, 0.93, 0.96])
    said: list[str] = []
    watch = HostMemoryWatch(0.90, 0.95, say=said.append, reading=lambda: next(readings))
    assert watch.check() is None and said == []
    assert watch.check() is None and len(said) == 1 and "91%" in said[0] and "95%" in said[0]
    assert watch.check() is None and len(said) == 1  # warned once, not every step
    assert watch.check() == pytest.approx(0.96)


# -- the host-memory watch in a container: its cgroup limit, and a save that must fit -----------------
def _container(fake_cgroup, left: int) -> int:
    """FAKED (fake_cgroup): a container limit with `left` bytes of it free; returns the limit. Under the limit
    the machine has room to spare, so only the container's figures can trip the watch."""
    machine = memory.psutil.virtual_memory()
    limit = min(machine.total // 2, 8 * 2**30)
    if left > 0.05 * limit or machine.percent > 90:
        pytest.skip("this machine is too small (or too full) to stand for a container at 95% of its limit")
    fake_cgroup(limit, limit - left)
    return limit


def test_the_host_watch_trips_at_the_containers_limit_and_checkpoints(fake_cgroup, tmp_path):
    """The kernel kills at the cgroup's limit, not when the machine is full: the watch (its default reading)
    stops at 95% of the limit and checkpoints, the save fitting in what is left."""
    left = 4 * checkpoint.SAVE_HOST_CUSHION
    used = 1 - left / _container(fake_cgroup, left)
    out = tmp_path / "run"
    with pytest.raises(TrainingAborted) as stopped:
        fitone.train(cpu_config(batch_size=4, max_steps=5, out=str(out), preflight=False))
    assert str(stopped.value) == (f"host RAM {used:.0%} used, past the 95% limit (host_mem_stop), before the "
                                  f"kernel's OOM killer would end the run at step 1; checkpoint saved to "
                                  f"{out / 'checkpoints' / 'step-00000001'}; continue with the same command plus "
                                  "--resume")
    assert checkpoint.latest(out).name == "step-00000001"


@pytest.mark.parametrize("stop_at", [0.95, 1.0], ids=["host-guard", "periodic-save"])
def test_a_save_the_host_ram_cannot_hold_is_not_started_the_run_stops_saying_why(fake_cgroup, tmp_path, stop_at):
    """Where what is left cannot hold the save (checkpoint.save_host_bytes), a save is not started: the guard's
    emergency one (the run would be killed half-way through it), and a periodic one with the guard off (stop
    at 100%). One line, exit 1, no checkpoint and no partial folder; the earlier checkpoint is named."""
    out = tmp_path / "run"
    rc, _, err = run_main(["train", *CLI_RUN, "--max-steps", "3", "--save-every", "1", "--out", str(out)])
    assert rc == 0 and checkpoint.latest(out).name == "step-00000003"
    _container(fake_cgroup, checkpoint.SAVE_HOST_CUSHION // 4)
    rc, _, err = run_main(["train", f"host_mem_stop={stop_at}", "host_mem_warn=0.9", *CLI_RUN, "--max-steps", "6",
                           "--save-every", "1", "--out", str(out), "--resume", "--no-preflight"])
    assert rc == 1
    (line,) = [line for line in err.splitlines() if line.startswith("fitone:")]
    start = (r"host RAM \d+% used, past the 95% limit \(host_mem_stop\), before the kernel's OOM killer would end "
             r"the run at step 4; not saved, because " if stop_at < 1 else
             r"stopped at step 4 instead of writing a checkpoint, because ")
    assert re.fullmatch(r"fitone: error: " + start + r"a checkpoint save needs 0\.06 GiB of host RAM beyond "
                        r"training's and 0\.02 GiB is left \(the kernel's OOM killer would end it half-written\); "
                        r"free host memory, or plan a smaller run with `fitone plan`; the last good checkpoint is "
                        r"\S+step-00000003: add --resume to continue from it", line), line
    # as the first run left them (it keeps 2): nothing written, nothing half-written
    assert sorted(p.name for p in checkpoint.checkpoint_root(out).iterdir()) == ["step-00000002", "step-00000003"]
