"""The batch-size search of `fitone probe-batch`, driven by fake trial functions.

The fakes stand in for the GPU, which this CPU machine does not have: a size fits while it is <= a
limit, peak memory is a + b x size, a step takes c + d x size seconds. The engine-based trial function
is tested elsewhere; here only the search's decisions are under test.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.probe.results import ProbeResult, TrialResult
from fitone.probe.search import granularity_at, search_batch_size
from fitone.units import GIB

MIB = 1024**2
FIXED = 6 * GIB  # a: weights, buffers, allocator slack
PER_SAMPLE = 50 * MIB  # b: activations of one sample


class FakeGPU:
    """Fakes the GPU: fits while size <= limit (or verify_limit over more than one step)."""

    def __init__(self, limit: int, *, verify_limit: int | None = None, oom_phase: str = "backward",
                 step_s=lambda size: 1.7 + 0.01 * size, fail_at: int | None = None):
        self.limit = limit
        self.verify_limit = limit if verify_limit is None else verify_limit
        self.oom_phase = oom_phase
        self.step_s = step_s
        self.fail_at = fail_at
        self.calls: list[tuple[int, int]] = []

    def peak(self, size: int) -> int:
        return FIXED + PER_SAMPLE * size

    def __call__(self, size: int, steps: int) -> TrialResult:
        self.calls.append((size, steps))
        if size == self.fail_at:
            raise ValueError(f"tokenizer exploded at {size}")
        limit = self.limit if steps == 1 else self.verify_limit
        if size > limit:
            return TrialResult(size, fits=False, oom_phase=self.oom_phase, steps=0)
        return TrialResult(size, fits=True, peak_gpu_bytes=self.peak(size), step_s=self.step_s(size), steps=steps)

    @property
    def sizes(self) -> list[int]:
        return [size for size, _ in self.calls]


def quiet(_line: str) -> None:
    pass


def test_doubling_then_bisection_then_margin_tries_these_sizes():
    gpu = FakeGPU(limit=100)
    result = search_batch_size(gpu, log=quiet)
    # double to the first OOM (128); bisect 64..128 until hi - lo <= 100 // 16 = 6; 5% margin; verify
    assert gpu.sizes == [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 95]
    assert [steps for _, steps in gpu.calls] == [1] * 12 + [3]
    assert result.largest_fit == 100
    assert result.smallest_oom == 104
    assert result.granularity == 6 == granularity_at(100)
    assert result.chosen == 95 and result.verified
    assert [t.purpose for t in result.trials] == ["search"] * 12 + ["verify"]
    assert [t.batch_size for t in result.trials] == gpu.sizes


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 33, 100, 257, 1000, 3000])
def test_search_brackets_the_true_limit_within_the_granularity(limit):
    result = search_batch_size(FakeGPU(limit=limit), margin=0.0, max_trials=40, log=quiet)
    assert result.largest_fit <= limit < result.smallest_oom
    assert result.smallest_oom - result.largest_fit <= result.granularity == granularity_at(result.largest_fit)


@pytest.mark.parametrize("margin, largest, chosen", [(0.0, 100, 100), (0.05, 100, 95), (0.1, 100, 90),
                                                     (0.05, 58, 55), (0.3, 3, 2), (0.49, 1, 1),
                                                     (0.3, 90, 63)])  # 90 x 0.7 is 62.999... in floats
def test_margin_is_floor_of_largest_times_one_minus_margin(margin, largest, chosen):
    result = search_batch_size(FakeGPU(limit=largest), margin=margin, max_batch=largest, log=quiet)
    assert result.largest_fit == largest
    assert result.chosen == chosen
    assert result.trials[-1].batch_size == chosen and result.trials[-1].purpose == "verify"


def test_verification_oom_steps_down_and_verifies_again():
    # over 3 steps only 90 fits (fragmentation grows): 95 fails, then 95 - max(6, ceil(95 x 0.05)) = 89
    gpu = FakeGPU(limit=100, verify_limit=90)
    lines: list[str] = []
    result = search_batch_size(gpu, log=lines.append)
    assert gpu.calls[-2:] == [(95, 3), (89, 3)]
    assert result.chosen == 89 and result.verified and result.largest_fit == 100
    assert any("95 out of memory in backward during verification; stepping down to 89" in line for line in lines)


def test_verification_that_keeps_failing_asks_for_a_larger_margin():
    with pytest.raises(MemoryBudgetError, match="--margin"):
        search_batch_size(FakeGPU(limit=100, verify_limit=50), log=quiet)


def test_verify_steps_zero_skips_verification():
    gpu = FakeGPU(limit=100)
    result = search_batch_size(gpu, verify_steps=0, log=quiet)
    assert gpu.sizes[-1] == 100 and result.chosen == 95 and not result.verified


def test_last_probe_is_clamped_to_max_batch():
    gpu = FakeGPU(limit=1000)
    result = search_batch_size(gpu, max_batch=100, log=quiet)
    assert gpu.sizes == [1, 2, 4, 8, 16, 32, 64, 100, 95]
    assert result.largest_fit == 100 and result.smallest_oom is None


def test_max_trials_bounds_the_search():
    gpu = FakeGPU(limit=100)
    result = search_batch_size(gpu, max_trials=5, log=quiet)
    assert gpu.sizes == [1, 2, 4, 8, 16, 15]  # 5 search trials, then verification of floor(16 x 0.95)
    assert result.largest_fit == 16


def test_start_that_fails_halves_down_then_bisects():
    gpu = FakeGPU(limit=100)
    result = search_batch_size(gpu, start=512, log=quiet)
    assert gpu.sizes == [512, 256, 128, 64, 96, 112, 104, 100, 95]
    assert result.largest_fit == 100


def test_memory_line_jumps_to_the_predicted_limit_and_confirms_one_step_above():
    gpu = FakeGPU(limit=100)
    cap = FIXED + 100 * PER_SAMPLE  # the line through any two sizes predicts exactly 100
    lines: list[str] = []
    result = search_batch_size(gpu, cap_bytes=cap, log=lines.append)
    # doubling stops at 64 because 128 is predicted not to fit; 100 fits, 106 = 100 + 6 does not
    assert gpu.sizes == [1, 2, 4, 8, 16, 32, 64, 100, 106, 95]
    assert result.largest_fit == 100 and result.smallest_oom == 106
    assert any("trying 100 (the memory line predicts 100" in line for line in lines)
    fixed, per_sample = result.memory_line()
    assert fixed == pytest.approx(FIXED) and per_sample == pytest.approx(PER_SAMPLE)


def test_memory_line_overshoot_falls_back_to_bisection():
    # fragmentation: the line predicts 100 but 90 is the real limit
    gpu = FakeGPU(limit=90)
    result = search_batch_size(gpu, cap_bytes=FIXED + 100 * PER_SAMPLE, log=quiet)
    assert gpu.sizes == [1, 2, 4, 8, 16, 32, 64, 100, 82, 91, 86, 81]
    assert result.largest_fit == 86 and result.smallest_oom == 91


def test_memory_line_undershoot_resumes_doubling():
    gpu = FakeGPU(limit=100)
    result = search_batch_size(gpu, cap_bytes=FIXED + 80 * PER_SAMPLE, log=quiet)
    # 80 and its confirmation 85 both fit, so the line is dropped and doubling resumes from 85
    assert gpu.sizes == [1, 2, 4, 8, 16, 32, 64, 80, 85, 170, 127, 106, 95, 100, 95]
    assert result.largest_fit == 100


def test_every_decision_is_logged_in_words():
    lines: list[str] = []
    search_batch_size(FakeGPU(limit=100), log=lines.append)
    assert re.fullmatch(r"64 fits: \d+\.\d GiB peak, \d+\.\d samples/s; trying 128", lines[6])
    assert lines[7] == "128 out of memory in backward; bisecting 64..128: trying 96"
    assert "100 fits and 104 does not (granularity 6): stopping" in lines[11]
    assert lines[12] == "largest fit 100; with a 5% margin choosing 95; verifying over 3 steps"
    assert lines[13].startswith("95 fits:") and lines[13].endswith("verified")


def test_a_non_oom_error_from_the_trial_propagates_unchanged():
    gpu = FakeGPU(limit=100, fail_at=8)
    with pytest.raises(ValueError, match="tokenizer exploded at 8"):
        search_batch_size(gpu, log=quiet)
    assert gpu.sizes == [1, 2, 4, 8]


@pytest.mark.parametrize("start", [1, 4])
def test_size_one_out_of_memory_names_what_to_change(start):
    gpu = FakeGPU(limit=0, oom_phase="forward")
    with pytest.raises(MemoryBudgetError) as info:
        search_batch_size(gpu, start=start, cap_bytes=23 * GIB, log=quiet)
    message = str(info.value)
    assert gpu.sizes[-1] == 1
    assert "\n" not in message
    for fix in ("batch size 1", "forward", "23.0 GiB", "--src-len", "--tgt-len", "--seq-len",
                "--max-gpu-memory", "bf16", "--activation-checkpointing", "fitone plan"):
        assert fix in message


@pytest.mark.parametrize("arguments, flag", [
    ({"max_batch": 0}, "--max-batch"),
    ({"max_trials": 0}, "--max-trials"),
    ({"margin": -0.01}, "--margin"),
    ({"margin": 0.5}, "--margin"),
    ({"start": 0}, "--start"),
    ({"start": 64, "max_batch": 32}, "--max-batch"),
    ({"verify_steps": -1}, "--verify-steps"),
])
def test_bad_arguments_raise_config_error_naming_the_flag(arguments, flag):
    gpu = FakeGPU(limit=100)
    with pytest.raises(ConfigError, match=flag):
        search_batch_size(gpu, log=quiet, **arguments)
    assert gpu.calls == []  # refused before any trial


def test_best_throughput_can_be_below_the_largest_fit():
    # step time grows with size squared: samples/s = s / (1 + s^2/1000) peaks near sqrt(1000) ~ 32
    gpu = FakeGPU(limit=100, step_s=lambda size: 1 + size * size / 1000)
    result = search_batch_size(gpu, log=quiet)
    tried = {t.batch_size for t in result.trials if t.fits}
    assert result.best_throughput == max(tried, key=lambda s: s / gpu.step_s(s)) == 32
    assert result.best_throughput < result.largest_fit


def test_best_throughput_never_exceeds_the_chosen_size():
    # throughput rises with size: the best is the chosen size, not the unverified largest fit
    result = search_batch_size(FakeGPU(limit=100), log=quiet)
    assert result.best_throughput == result.chosen == 95


@pytest.mark.parametrize("global_batch, world_size, expected", [
    (256, 1, (64, 4)), (256, 2, (64, 2)), (90, 1, (90, 1)), (95, 1, (95, 1)), (190, 1, (95, 2)), (97, 1, (1, 97)),
])
def test_for_global_batch_picks_the_largest_dividing_micro_batch(global_batch, world_size, expected):
    result = search_batch_size(FakeGPU(limit=100), log=quiet)  # chosen 95
    micro, accum = result.for_global_batch(global_batch, world_size)
    assert (micro, accum) == expected
    assert micro <= result.chosen and micro * accum * world_size == global_batch


@pytest.mark.parametrize("global_batch, world_size", [(255, 2), (0, 1), (8, 0)])
def test_for_global_batch_refuses_what_cannot_split(global_batch, world_size):
    result = search_batch_size(FakeGPU(limit=100), log=quiet)
    with pytest.raises(ConfigError, match="--global-batch"):
        result.for_global_batch(global_batch, world_size)


def test_json_round_trip_keeps_every_field(tmp_path):
    result = search_batch_size(FakeGPU(limit=100), cap_bytes=23 * GIB, log=quiet)
    result.meta.update(model="t5-3b", src_len=128, tgt_len=128, precision="fp16")
    path = result.save_json(tmp_path / "probe.json")
    assert json.loads(path.read_text())["chosen"] == 95
    loaded = ProbeResult.load_json(path)
    assert loaded == result
    assert loaded.trials[-1].purpose == "verify"
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()


def test_table_and_summary_show_each_trial_and_the_answer():
    result = search_batch_size(FakeGPU(limit=100), cap_bytes=23 * GIB, log=quiet)
    table = result.table()
    lines = table.splitlines()
    assert len(lines) == 1 + len(result.trials) + 3
    assert re.match(r"\s+128\s+OOM \(backward\)\s+-\s+-\s+-$", lines[8])
    assert "largest fit: 100 (104 ran out of memory), granularity 6" in table
    assert "chosen: 95 (5% margin, verified, cap 23.0 GiB)" in table
    assert "best throughput: 95" in table
    assert repr(result).startswith("ProbeResult(chosen=95, largest_fit=100, smallest_oom=104")
    assert str(result) == repr(result)


def test_plot_writes_a_png(tmp_path):
    result = search_batch_size(FakeGPU(limit=100), cap_bytes=FIXED + 100 * PER_SAMPLE, log=quiet)
    result.meta.update(model="t5-3b", precision="fp16")
    path = result.plot(tmp_path / "probe.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_cap_or_measurements_still_writes_a_png(tmp_path):
    def unmeasured(size: int, steps: int) -> TrialResult:
        return TrialResult(size, fits=size <= 20, steps=steps)

    result = search_batch_size(unmeasured, log=quiet)
    assert result.best_throughput is None and result.memory_line() is None
    assert result.plot(tmp_path / "bare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_search_and_its_results_load_without_torch_and_leave_render_to_their_callers(tmp_path):
    """The search knows nothing of training, and results are data: render draws them when asked."""
    code = ("import sys, fitone.probe.search, fitone.probe.results\n"
            "heavy = ('torch', 'deepspeed', 'transformers', 'fitone.probe.trial')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr
    results = ast.parse((Path(__file__).parents[2] / "fitone" / "probe" / "results.py").read_text())
    top = {n.module for n in results.body if isinstance(n, ast.ImportFrom)}
    assert "fitone.render" not in top  # table() and plot() import it when called: no render -> results -> render
