"""Which steps the tool comparison times and splits (scripts/_tools_measure.timed_window,
scripts/_tools_split.split_fields): pure bookkeeping over a run's per-step records, no engine needed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from _tools_measure import SKIP_MARGIN, timed_window  # noqa: E402
from _tools_split import split_fields  # noqa: E402


def test_the_warm_up_goes_on_while_the_step_before_was_skipped_up_to_the_margin():
    ok, skip = False, True
    assert timed_window([ok, ok, ok, ok, ok, ok], warm=2, margin=SKIP_MARGIN) == 2
    assert timed_window([skip, skip, skip, ok, ok, ok, ok], warm=2, margin=SKIP_MARGIN) == 4  # past both skips
    # skipped all through the margin: the window starts where the margin ends, never later
    assert timed_window([skip] * 8, warm=2, margin=SKIP_MARGIN) == 2 + SKIP_MARGIN
    assert timed_window([skip] * 8, warm=2, margin=0) == 2  # bf16 / fp32: no margin at all
    # a skip inside the warm-up but not in its last step does not move the window
    assert timed_window([skip, ok, ok, ok], warm=2, margin=SKIP_MARGIN) == 2


def _timer(steps: list[dict[str, float]], applied: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(steps=steps, applied=applied)


def test_the_split_takes_applied_timed_steps_and_the_detail_range_alone():
    steps = [{"forward_s": float(i), "backward_s": 1.0, "optimizer_s": 2.0} for i in range(8)]
    steps[3]["update_cpu_adam_s"] = 0.5  # an overlapped update completed in step 3 only
    steps[6]["cpu_adam_s"], steps[7]["cpu_adam_s"] = 0.25, 0.75
    applied = [True, True, True, True, False, True, True, True]
    out = split_fields(_timer(steps, applied), 2, 6, detail=(6, 8))
    # timed [2, 6) less skipped step 4: forward 2, 3, 5; the update_* key over the one step that has it
    assert out["split"] == {"forward_s": 3.0, "backward_s": 1.0, "optimizer_s": 2.0, "update_cpu_adam_s": 0.5}
    assert out["split_detail"]["cpu_adam_s"] == 0.5 and out["split_detail"]["forward_s"] == 6.5
    # an explicit range that is a subset of what follows the timed window: only that range counts
    assert split_fields(_timer(steps, applied), 2, 6, detail=(7, 8))["split_detail"]["cpu_adam_s"] == 0.75
    # default: every step after the timed window
    assert split_fields(_timer(steps, applied), 2, 6)["split_detail"]["forward_s"] == 6.5


def test_a_detail_range_with_every_step_skipped_says_so_and_an_empty_one_is_absent():
    steps = [{"forward_s": 1.0, "backward_s": 1.0, "optimizer_s": 1.0} for _ in range(4)]
    out = split_fields(_timer(steps, [True, True, False, False]), 0, 2, detail=(2, 4))
    assert "split_detail" not in out and "fp16 overflow" in out["split_detail_note"]
    out = split_fields(_timer(steps, [True] * 4), 0, 4, detail=(4, 4), init_peak_gib=1.5)
    assert "split_detail" not in out and "split_detail_note" not in out and out["peak_gpu_init_gib"] == 1.5
