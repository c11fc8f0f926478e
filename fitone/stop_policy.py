"""When training stops early, and whether a step's checkpoint is written: the guards' flags, agreed by every
rank, turned into one decision per step. What each decision does (save, abort) is the Trainer's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from fitone import memory
from fitone.guards import BadStepStreak, HostMemoryWatch, StopRequest
from fitone.units import gib

Say = Callable[[str], None]
Agree = Callable[..., list[bool]]  # Runtime.agree: a flag raised on any rank is raised on all


@dataclass(frozen=True)
class AfterStep:
    """What to do after one optimizer step, in this order."""

    numerics: str | None = None  # why to stop without saving: a NaN/overflow streak
    save: bool = False  # the periodic checkpoint is due (and the state is good)
    stop: str | None = None  # why to save (where it fits) and stop: a signal, host RAM past its limit


class StopPolicy:
    """The signal handler (while entered), the NaN/overflow streak and the host-RAM watch of one run."""

    def __init__(self, *, save_every: int | None, max_bad_steps: int, host_mem_warn: float, host_mem_stop: float,
                 agree: Agree, say: Say):
        self.save_every, self.host_mem_stop, self.agree = save_every, host_mem_stop, agree
        self.bad = BadStepStreak(max_bad_steps)
        self.host = HostMemoryWatch(host_mem_warn, host_mem_stop, say=say)
        self.request = StopRequest()

    def __enter__(self) -> StopPolicy:
        self.request.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.request.__exit__(*exc)

    @property
    def state_is_good(self) -> bool:
        """The last step's loss was finite: its weights may be saved or exported."""
        return self.bad.state_is_good

    def after_step(self, step: int, loss: float, applied: bool) -> AfterStep:
        """A NaN/overflow streak stops without saving; then the periodic checkpoint; then a signal or host RAM
        past its limit saves (unless just saved) and stops. The same answer on every rank."""
        used = self.host.check()
        nan_loss, stop_asked, host_full = self.agree(not math.isfinite(loss), self.request.requested,
                                                     used is not None)
        bad = self.bad
        if bad.update(math.nan if nan_loss else loss, applied):
            return AfterStep(numerics=f"{bad.streak} steps in a row had a NaN/inf loss or skipped their update")
        stop = None
        if stop_asked:
            stop = f"stopped by {self.request.signal_name or 'a signal to another rank'}"
        elif host_full:
            stop = (f"host RAM {used or memory.host_used_fraction():.0%} used, past the {self.host_mem_stop:.0%} "
                    "limit (host_mem_stop), before the kernel's OOM killer would end the run")
        # never after a NaN/inf loss; a stop saves, if it fits
        save = bool(self.save_every) and step % self.save_every == 0 and bad.state_is_good and stop is None
        return AfterStep(save=save, stop=stop)

    def save_short(self, need: int) -> str | None:
        """Why a checkpoint save must not start now (None: it fits): the host RAM it takes beyond training's
        (`need`: checkpoint.save_host_bytes) is more than is left. The same answer on every rank."""
        left = memory.host_available_bytes()
        if not self.agree(need > left)[0]:
            return None
        return (f"a checkpoint save needs {gib(need):.2f} GiB of host RAM beyond training's and "
                f"{gib(left):.2f} GiB is left (the kernel's OOM killer would end it half-written); free host memory, "
                "or plan a smaller run with `fitone plan`")
