"""The batch-size search of `fitone probe-batch`, driven by fake trial functions.

The fakes stand in for the GPU, which this CPU machine does not have: a size fits while it is <= a
limit, peak memory is a + b x size, a step takes c + d x size seconds. The engine-based trial function
is tested elsewhere; here only the search's decisions are under test.
"""

from __future__ import annotations

import ast
import dataclasses
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
from fitone.units import GIB, gib

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

    def __call__(self, size: int, steps: int, accumulation: int = 1) -> TrialResult:
        """A step of `accumulation` micro-batches takes that many times one (the update is free here)."""
        self.calls.append((size, steps))
        if size == self.fail_at:
            raise ValueError(f"tokenizer exploded at {size}")
        limit = self.limit if steps == 1 else self.verify_limit
        if size > limit:
            return TrialResult(size, fits=False, oom_phase=self.oom_phase, steps=0, accumulation=accumulation)
        return TrialResult(size, fits=True, peak_gpu_bytes=self.peak(size), step_s=accumulation * self.step_s(size),
                           steps=steps, accumulation=accumulation)

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


# -- the choice of micro-batch x accumulation (fitone.probe.choice) ----------------------------------
class OffloadGPU(FakeGPU):
    """Fakes a GPU whose forward and backward slow down per sample as the micro-batch grows (c(b) below),
    beside an optimizer update of UPDATE_S per step: a step of micro-batch b with accumulation a takes
    a x c(b) + UPDATE_S, so for a fixed global batch a smaller micro-batch with more accumulation can win."""

    UPDATE_S = 1.0

    def __init__(self, limit: int = 100):
        super().__init__(limit, step_s=lambda size: self.pass_s(size) + self.UPDATE_S)
        self.accumulations: list[int] = []

    @staticmethod
    def pass_s(size: int) -> float:
        return 0.01 * size + 0.0002 * size * size

    def __call__(self, size: int, steps: int, accumulation: int = 1) -> TrialResult:
        self.accumulations.append(accumulation)
        trial = super().__call__(size, steps, accumulation)
        if not trial.fits:
            return trial
        return dataclasses.replace(trial, step_s=accumulation * self.pass_s(size) + self.UPDATE_S, samples_per_s=None)


def chose(gpu: FakeGPU, prefer: str, global_batch: int | None = None, **config):
    """The search on `gpu`, then the choice for `global_batch` with TrainConfig's own accumulation."""
    from fitone.config import TrainConfig
    from fitone.probe.choice import choose_batch

    cfg = TrainConfig(global_batch=global_batch, prefer_batch=prefer, **config)
    result = search_batch_size(gpu, log=quiet)  # chosen 95 (largest fit 100, 5% margin)
    lines: list[str] = []
    choose_batch(result, prefer=prefer, accumulation=cfg.accumulation, global_batch=global_batch,
                 time_step=gpu, steps=3, log=lines.append)
    return result, lines


def test_throughput_chooses_a_smaller_micro_batch_with_accumulation_when_it_is_faster():
    gpu = OffloadGPU()
    result, lines = chose(gpu, "throughput", global_batch=96)
    # divisors of 96 up to 95: 48 x 2 (the largest), then the nearest below the fastest one-step trials
    timed = result.candidates()
    assert [(t.batch_size, t.accumulation) for t in timed] == [(48, 2), (32, 3), (16, 6)]
    assert all(t.steps == 3 and t.purpose == "throughput" for t in timed)
    assert gpu.calls[-3:] == [(48, 3), (32, 3), (16, 3)] and gpu.accumulations[-3:] == [2, 3, 6]
    best = max(timed, key=lambda t: t.samples_per_s)
    assert (result.micro_batch, result.accumulation) == (best.batch_size, best.accumulation) == (16, 6)
    assert best.samples_per_s == pytest.approx(96 / (6 * OffloadGPU.pass_s(16) + 1.0))
    assert result.prefer == "throughput" and result.global_batch == 96 and result.chosen == 95
    assert any(line.startswith("choosing 16 x 6: ") and "more than 48 x 2" in line for line in lines)
    assert "train with: micro-batch 16 x 6 accumulation steps (for --global-batch 96: the most samples/s of 3 " \
           "timed" in result.table()
    assert "16 x 6  fits timed" in result.table()


def test_prefer_largest_keeps_the_old_choice_times_nothing_and_checks_it_accumulating():
    gpu = OffloadGPU()
    result, lines = chose(gpu, "largest", global_batch=96)
    assert (result.micro_batch, result.accumulation) == (48, 2) == result.for_global_batch(96)
    assert result.candidates() == [] and gpu.accumulations[-1] == 2 and set(gpu.accumulations[:-1]) == {1}
    assert [(t.batch_size, t.accumulation, t.steps, t.purpose) for t in result.trials][-1] == (48, 2, 3, "check")
    assert any(line.startswith("48 x 2 fits: ") and "over 3 steps of 2 micro-batches: 48 x 2 checked" in line
               for line in lines)
    assert "train with: micro-batch 48 x 2 accumulation steps (for --global-batch 96: the largest within the " \
           "margin that divides it; --prefer-batch largest)" in result.table()
    assert "48 x 2  fits check" in result.table()


# -- accumulating costs memory: the pair chosen has run accumulated steps ------------------------------------
ACCUMULATING = 1100 * MIB  # the fake's extra at accumulation > 1: one more 545M-element bf16 tensor


class AccumulatingGPU(OffloadGPU):
    """Fakes a GPU with a cap where a step of more than one micro-batch holds ACCUMULATING bytes more (as a
    real one holds the previous micro-batch's reduced gradients): 100 fits at one micro-batch a step, only
    78 when accumulating. Larger micro-batches are faster per sample, so the largest pair wins when it fits."""

    CAP = FIXED + 100 * PER_SAMPLE
    EXTRA = ACCUMULATING

    def __call__(self, size: int, steps: int, accumulation: int = 1) -> TrialResult:
        self.calls.append((size, steps))
        self.accumulations.append(accumulation)
        peak = FIXED + PER_SAMPLE * size + (self.EXTRA if accumulation > 1 else 0)
        if peak > self.CAP:
            return TrialResult(size, fits=False, oom_phase="forward", steps=0, accumulation=accumulation)
        return TrialResult(size, fits=True, peak_gpu_bytes=peak, step_s=accumulation * (1 + 0.001 * size) + 1.0,
                           steps=steps, accumulation=accumulation)


def test_accumulating_gpu_fits_fewer_samples_when_accumulating():
    gpu = AccumulatingGPU()
    assert gpu(100, 1).fits and not gpu(101, 1).fits
    assert gpu(78, 1, 2).fits and not gpu(79, 1, 2).fits and gpu(79, 1, 1).fits


def test_throughput_never_chooses_a_largest_pair_that_ran_out_of_memory_accumulating():
    # fails before issue 27's fix: 80 x 2 ran out of memory in its timing and was chosen anyway
    result, lines = chose(AccumulatingGPU(), "throughput", global_batch=160)
    timed = {(t.batch_size, t.accumulation): t.fits for t in result.candidates()}
    assert timed[(80, 2)] is False  # chosen 95: 80 x 2 is the largest pair; it fits only at one micro-batch a step
    assert (result.micro_batch, result.accumulation) != (80, 2)
    pair = (result.micro_batch, result.accumulation)
    assert any(t.fits and (t.batch_size, t.accumulation) == pair and t.accumulation > 1 for t in result.trials)
    assert any("80 x 2 ran out of memory: comparing with" in line for line in lines)


def test_largest_steps_down_to_the_next_dividing_pair_when_the_check_runs_out_of_memory():
    # fails before the fix: the largest choice ran no accumulated step and returned 80 x 2
    gpu = AccumulatingGPU()
    result, lines = chose(gpu, "largest", global_batch=160)
    checks = [(t.batch_size, t.accumulation, t.fits) for t in result.trials if t.purpose == "check"]
    assert checks == [(80, 2, False), (40, 2, True)]  # 2 micro-batches a step check any accumulation
    assert (result.micro_batch, result.accumulation) == (40, 4)
    assert any("80 x 2 out of memory in forward accumulating; stepping down" in line for line in lines)
    peak = gib(FIXED + 40 * PER_SAMPLE + ACCUMULATING)
    assert any(line.startswith(f"40 x 2 fits: {peak:.1f} GiB peak") and "40 x 4 checked" in line for line in lines)
    assert any(line == "for --global-batch 160: 40 x 4, the largest micro-batch that divides it and runs "
               "accumulated steps" for line in lines)


def test_a_pair_that_keeps_running_out_of_memory_accumulating_asks_for_a_larger_margin():
    from fitone.probe.choice import MAX_CHECK_TRIES

    class Tight(AccumulatingGPU):
        EXTRA = 100 * PER_SAMPLE  # no micro-batch fits accumulating

    gpu = Tight()
    with pytest.raises(MemoryBudgetError, match="ran out of memory accumulating although 95 fitted at one "
                       "micro-batch a step: use a larger --margin"):
        chose(gpu, "largest", global_batch=96 * 5)  # pairs 80 x 6, 60 x 8, 48 x 10, ...
    assert gpu.accumulations.count(2) == MAX_CHECK_TRIES


def test_a_saved_search_is_chosen_again_only_where_its_trials_cover_the_accumulation():
    from fitone.config import TrainConfig
    from fitone.probe.choice import UncheckedChoice, choose_batch

    result, _ = chose(AccumulatingGPU(), "largest", global_batch=160)  # 40 x 4 checked, 80 x 2 ran out
    again = dataclasses.replace(result, trials=list(result.trials))
    for global_batch, pair in [(160, (40, 4)), (117, (39, 3)), (95, (95, 1))]:  # covered: no time_step needed
        choose_batch(again, prefer="largest", accumulation=TrainConfig(global_batch=global_batch).accumulation,
                     global_batch=global_batch, log=quiet)
        assert (again.micro_batch, again.accumulation) == pair
    with pytest.raises(UncheckedChoice, match="60 x 2 has not run accumulated steps"):  # 40 < 60 < 80
        choose_batch(again, prefer="largest", accumulation=TrainConfig(global_batch=120).accumulation,
                     global_batch=120, log=quiet)


def test_a_smaller_micro_batch_must_beat_the_largest_by_the_tolerance():
    from fitone.config import TrainConfig
    from fitone.probe.choice import TOLERANCE, choose_batch

    gpu = OffloadGPU()

    def nearly_flat(size: int, steps: int, accumulation: int = 1) -> TrialResult:
        # every smaller micro-batch 1% faster than the largest: within the timing noise the choice allows
        trial = gpu(size, steps, accumulation)
        return dataclasses.replace(trial, samples_per_s=100.0 if size == 48 else 101.0)

    result = search_batch_size(gpu, log=quiet)
    choose_batch(result, prefer="throughput", accumulation=TrainConfig(global_batch=96).accumulation,
                 global_batch=96, time_step=nearly_flat, steps=3, log=quiet)
    assert 0.01 < TOLERANCE and len(result.candidates()) == 3
    assert (result.micro_batch, result.accumulation) == (48, 2)


@pytest.mark.parametrize("global_batch, pairs", [
    (97, [(1, 97)]),  # prime: only 1 divides it below the chosen 95
    (100, [(50, 2), (25, 4), (20, 5), (10, 10)]),  # not a multiple of 95: its divisors
    (190, [(95, 2), (38, 5), (19, 10), (10, 19)]),
])
def test_a_global_batch_the_largest_does_not_divide_is_split_exactly(global_batch, pairs):
    result, _ = chose(OffloadGPU(), "throughput", global_batch=global_batch)
    assert (result.micro_batch, result.accumulation) in pairs
    assert result.micro_batch * result.accumulation == global_batch and result.micro_batch <= result.chosen
    timed = result.candidates()
    assert all(t.batch_size * t.accumulation == global_batch for t in timed)
    assert len(timed) == (0 if len(pairs) == 1 else 3)  # one candidate: nothing to compare, nothing timed


def test_without_a_global_batch_the_choice_is_among_micro_batches_by_samples_per_second():
    # step time grows with size squared: samples/s peaks near 32, well below the chosen 95
    gpu = FakeGPU(limit=100, step_s=lambda size: 1 + size * size / 1000)
    result, _ = chose(gpu, "throughput")
    timed = result.candidates()
    assert [(t.batch_size, t.accumulation) for t in timed] == [(95, 1), (32, 1), (16, 1)]
    assert (result.micro_batch, result.accumulation) == (32, 1) and result.global_batch is None
    fixed, _ = chose(FakeGPU(limit=100, step_s=lambda size: 1 + size * size / 1000), "throughput", grad_accum=4)
    assert (fixed.micro_batch, fixed.accumulation) == (32, 4)  # a --grad-accum stays as given


def test_a_global_batch_the_gpus_do_not_split_is_refused_naming_the_fix():
    from fitone.config import TrainConfig
    from fitone.probe.choice import choose_batch

    result = search_batch_size(FakeGPU(limit=100), log=quiet)
    cfg = TrainConfig(global_batch=255)
    with pytest.raises(ConfigError, match="--global-batch 255 is not a multiple of micro-batch x GPUs"):
        choose_batch(result, prefer="throughput", accumulation=lambda b: cfg.accumulation(b, 2),
                     global_batch=255, time_step=FakeGPU(limit=100), log=quiet)


def test_the_choice_round_trips_through_json_and_into_a_recipe(tmp_path):
    from fitone.config import TrainConfig
    from fitone.recipes import save_to_recipe

    result, _ = chose(OffloadGPU(), "throughput", global_batch=96)
    result.meta.update(model="t5-3b", precision="fp16", src_len=128, tgt_len=128, gpu="NVIDIA H200")
    saved = json.loads(result.save_json(tmp_path / "probe.json").read_text())
    assert (saved["micro_batch"], saved["accumulation"], saved["global_batch"], saved["prefer"]) == (16, 6, 96,
                                                                                                      "throughput")
    assert [(t["batch_size"], t["accumulation"]) for t in saved["trials"] if t["purpose"] == "throughput"] == \
        [(48, 2), (32, 3), (16, 6)]
    assert ProbeResult.load_json(tmp_path / "probe.json") == result
    assert result.plot(tmp_path / "probe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # with the timed pairs
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# mine\nmodel: t5-3b\nbatch_size: 8  # per GPU\n")
    save_to_recipe(result, recipe)
    text = recipe.read_text()
    assert "batch_size: 16  # per GPU\n" in text and "global_batch: 96\n" in text
    assert "# probe-batch: batch_size 16 x 6 accumulation, the most samples/s timed" in text
    cfg = TrainConfig.from_dict(__import__("yaml").safe_load(text))
    assert (cfg.batch_size, cfg.accumulation(cfg.batch_size)) == (16, 6)
