"""Watches that stop training cleanly: signals, NaN/overflow streaks, host memory.

Each one only raises a flag at a step boundary; the trainer then writes a checkpoint (where the
state is good) and stops, so nothing done so far is lost.
"""

from __future__ import annotations

import math
import signal
import threading
from typing import Callable

from fitone import memory

T5_FAMILY = ("t5", "mt5", "umt5", "longt5", "switch_transformers")


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, checkpoint, exit. A second one: exit at once.

    The second signal raises KeyboardInterrupt wherever the process is, even inside a save: saves are
    atomic (checkpoint.py), so what is on disk stays complete or absent.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt  # second signal: leave now
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


class BadStepStreak:
    """Counts consecutive steps whose loss is NaN/inf or whose update was skipped (fp16 overflow)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.streak = 0
        self.total_skipped = 0
        self.last_loss_finite = True

    def update(self, loss: float, applied: bool) -> bool:
        """Record one optimizer step; True when the streak has reached the limit."""
        self.last_loss_finite = math.isfinite(loss)
        bad = not self.last_loss_finite or not applied
        self.total_skipped += int(not applied)
        self.streak = self.streak + 1 if bad else 0
        return self.streak >= self.limit

    @property
    def state_is_good(self) -> bool:
        """False after a NaN/inf loss: where DeepSpeed applied that update (e.g. bf16 with its overflow
        check off) the weights hold NaN, so this state is never checkpointed. A skipped fp16 update with
        a finite loss leaves the weights as they were."""
        return self.last_loss_finite


def numerics_advice(precision: str, model_type: str) -> str:
    """What to change when losses keep coming out NaN/inf or fp16 keeps skipping updates."""
    if precision == "fp16" and model_type in T5_FAMILY:
        return "T5 was pre-trained in bf16 and overflows in fp16: use --precision bf16 or fp32"
    if precision == "fp16":
        return "fp16 keeps overflowing: use --precision bf16 (or fp32), or lower --lr"
    return "lower --lr or add --warmup-steps, and check the data for broken examples"


class HostMemoryWatch:
    """Warn once when host RAM use passes `warn`; report a stop past `stop`, before the kernel's OOM killer.

    `say` prints the warning (the trainer's own channel, so it shows as one line above the progress bar).
    """

    def __init__(self, warn: float, stop: float, *, say: Callable[[str], None],
                 reading: Callable[[], float] = memory.host_used_fraction):
        self.warn, self.stop, self.say, self.reading = warn, stop, say, reading
        self.warned = False

    def check(self) -> float | None:
        """None while fine; the used fraction when it is time to stop."""
        used = self.reading()
        if used >= self.stop:
            return used
        if used >= self.warn and not self.warned:
            self.warned = True
            self.say(f"warning: host RAM {used:.0%} used; fitone checkpoints and stops at {self.stop:.0%}: close "
                     "other programs, or plan a smaller model with `fitone plan`")
        return None
