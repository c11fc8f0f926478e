"""The watches that stop a run cleanly: signals, NaN/overflow streaks, host RAM, and their advice."""

from __future__ import annotations

import math
import signal

import pytest

from fitone.guards import BadStepStreak, HostMemoryWatch, StopRequest, is_loss_scale_collapse, numerics_advice


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
