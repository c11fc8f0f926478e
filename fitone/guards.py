"""Watches that stop training cleanly: signals, NaN/overflow streaks, host memory.

Each one only raises a flag or a TrainingAborted at a step boundary; the trainer then writes a
checkpoint (where it is safe to) so nothing done so far is lost.
"""

from __future__ import annotations

import math
import signal
import threading
import warnings
from typing import Callable

from fitone import memory


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, checkpoint, exit. Second Ctrl-C: exit at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: leave now; checkpoints on disk are complete or absent
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

    def update(self, loss: float, applied: bool) -> bool:
        """True when the streak has reached the limit."""
        bad = not math.isfinite(loss) or not applied
        self.total_skipped += int(not applied)
        self.streak = self.streak + 1 if bad else 0
        return self.streak >= self.limit


class HostMemoryWatch:
    """Warn when host RAM use passes `warn`, ask to stop past `stop`, before the kernel's OOM killer."""

    def __init__(self, warn: float, stop: float, reading: Callable[[], float] = memory.host_used_fraction):
        self.warn, self.stop, self.reading = warn, stop, reading
        self.warned = False

    def check(self) -> float | None:
        """None while fine; the used fraction when it is time to stop."""
        used = self.reading()
        if used >= self.stop:
            return used
        if used >= self.warn and not self.warned:
            self.warned = True
            warnings.warn(f"host RAM {used:.0%} used (stops at {self.stop:.0%}): close other programs or use a "
                          "smaller model", RuntimeWarning, stacklevel=2)
        return None
