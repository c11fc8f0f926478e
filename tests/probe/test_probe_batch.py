"""probe-batch on real DeepSpeed ZeRO-2 + CPU-offload engines: the tiny T5 on the CPU.

A CPU cannot run out of memory the way a GPU does (it swaps, or the kernel kills the process), so these
tests FAKE THE GPU'S OUT-OF-MEMORY ERROR: a hook on the model raises torch.OutOfMemoryError (what PyTorch
raises when CUDA runs out) once a batch passes a token budget, either in forward or, through a tensor hook,
in the middle of backward. Everything else is real: model, engine, steps, the ZeRO-2 state an interrupted
backward leaves behind, the cache, the CLI and `fitone.train`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import json
import math
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import fitone
from conftest import cpu_config, run_main
from fitone.cli import main
from fitone.data import worst_case_batch
from fitone.engine import Engine
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.models import build_model, load_config
from fitone.probe import api as probe_api
from fitone.probe.api import probe_batch
from fitone.probe.cache import probe_key, read_cached, save_cached
from fitone.probe.results import ProbeResult, TrialResult
from fitone.probe.search import search_batch_size
from fitone.probe.trial import ProbeSession
from fitone.recipes import _recipe_values, save_to_recipe
from fitone.models import task_of
from fitone.run import resolve, resolve_planned, start_runtime

SRC_LEN = TGT_LEN = 8
# the CPU has no memory limit a search could find, so a probe there needs a ceiling; the faked OOMs come below it
CAP = 64


def quiet(_line: str) -> None:
    pass


def key_of(cfg, config, device: str) -> dict:
    """The probe key of the run `cfg` resolves to on `device` (as planned: this machine has no GPU), with the
    model config `config`."""
    run = resolve_planned(cfg.replace(device=device), 1)
    return probe_key(dataclasses.replace(run, model_config=config, task=task_of(config)))


def probe_config(**overrides):
    """The tiny T5 probed on the CPU. The search's tests choose the largest size (as before issue 29): which
    pair is fastest on this CPU is its timing's to say, so the throughput tests assert what follows from the
    times they measured, not which pair wins."""
    return cpu_config(src_len=SRC_LEN, tgt_len=TGT_LEN, **{"prefer_batch": "largest", **overrides})


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    """Every test saves its probes in its own folder, never in ~/.cache."""
    root = tmp_path / "fitone-cache"
    monkeypatch.setenv("FITONE_CACHE_DIR", str(root))
    return root / "probes"


class Budget:
    """The faked GPU: out of memory once the first decoder block sees more than `limit` samples of TGT_LEN tokens.

    phase "forward" raises in that block's forward; "backward" raises when that block's output gradient
    arrives, i.e. mid-backward, after the layers above it have handed their gradients to ZeRO-2.
    `error` replaces the OOM by another exception (to check that it is not taken for an OOM).
    """

    def __init__(self, limit: int, phase: str = "forward", error: type[Exception] = torch.OutOfMemoryError):
        self.limit, self.phase, self.error = limit, phase, error
        self.model_ref = None

    def __call__(self, model: torch.nn.Module) -> None:  # probe_batch's on_model
        self.model_ref = weakref.ref(model)
        model.decoder.block[0].register_forward_hook(self._forward)

    def _forward(self, _module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens <= self.limit * TGT_LEN:
            return
        if self.phase == "forward":
            raise self._fail(tokens)
        if hidden.requires_grad:
            def out_of_memory_in_backward(_grad):
                raise self._fail(tokens)

            hidden.register_hook(out_of_memory_in_backward)

    def _fail(self, tokens: int) -> Exception:
        return self.error(f"CUDA out of memory. Tried to allocate 2.00 MiB (faked: {tokens} tokens > "
                          f"{self.limit * TGT_LEN})")

    @property
    def model_freed(self) -> bool:
        return self.model_ref is not None and self.model_ref() is None


def sizes(result: ProbeResult) -> list[int]:
    return [t.batch_size for t in result.trials]


# -- the search on a real engine ------------------------------------------------------------------
def test_forward_oom_search_tries_these_sizes_then_backs_off_by_the_margin(cache_root):
    budget = Budget(limit=5, phase="forward")
    lines: list[str] = []
    result = probe_batch(probe_config(), max_batch=CAP, verify_steps=2, say=lines.append, on_model=budget)
    # double to the first OOM (8), bisect 4..8 down to granularity 1, choose floor(5 x 0.95) = 4, verify it
    assert sizes(result) == [1, 2, 4, 8, 6, 5, 4]
    assert [t.fits for t in result.trials] == [True, True, True, False, False, True, True]
    assert {t.oom_phase for t in result.trials if not t.fits} == {"forward"}
    assert result.largest_fit == 5 and result.smallest_oom == 6
    assert result.chosen == math.floor(5 * (1 - 0.05)) == 4 and result.margin == 0.05
    assert result.verified and result.trials[-1].steps == 2 and result.trials[-1].purpose == "verify"
    assert "8 out of memory in forward; bisecting 4..8: trying 6" in lines
    # every trial really ran on the CPU: timed, but no GPU peak to read
    assert all(t.step_s > 0 and t.peak_gpu_bytes is None for t in result.trials if t.fits)
    assert any("peak GPU memory is not measurable" in line for line in lines)
    meta = result.meta
    assert meta["model"] == "t5-tiny" and meta["precision"] == "fp32" and meta["activation_checkpointing"]
    assert (meta["src_len"], meta["tgt_len"]) == (SRC_LEN, TGT_LEN) and meta["worst_case"] == "maximum lengths"
    assert (meta["batch_input_tokens"], meta["batch_target_tokens"]) == (SRC_LEN, TGT_LEN)
    built = build_model(load_config("t5-tiny", from_scratch=True))
    assert meta["params"] == sum(p.numel() for p in built.parameters())
    assert meta["gpu"] == "cpu" and meta["engine_rebuilds"] == 0
    assert set(meta["versions"]) == {"fitone", "deepspeed", "torch", "transformers"}
    assert result.wall_s >= meta["engine_init_s"] + meta["search_s"]  # engine init counts
    assert budget.model_freed  # the probe's model and engine are gone once it returns
    assert [p.name for p in cache_root.iterdir()] == [meta["cache_file"].rsplit("/", 1)[-1]]


@pytest.mark.parametrize("how", ["asked for", "the default on a GPU"])
def test_with_the_pipelined_update_the_probe_trials_run_the_engine_training_will_run(monkeypatch, tmp_path, how):
    """Same faked budget and search as the default, on an engine with the pipelined update (its thread
    really runs between trials, and a backward OOM arrives while the forward hooks have waited for it).
    'the default on a GPU': this CPU cannot be one, so the step mode's decision is told it is (faked: on_gpu)."""
    if how == "the default on a GPU":
        from fitone.zero2 import step_mode

        real = step_mode.decide
        monkeypatch.setattr(step_mode, "decide", lambda ds, **kw: real(ds, **{**kw, "on_gpu": True}))
    built = []  # the update mode of each engine the probe builds

    def engine(*args, **kwargs):
        made = Engine(*args, **kwargs)
        built.append(type(made.overlap).__name__)
        return made

    monkeypatch.setattr("fitone.probe.trial.Engine", engine)
    cfg = probe_config(pipelined_update=True) if how == "asked for" else probe_config()
    result = probe_batch(cfg, max_batch=CAP, verify_steps=2, say=quiet, on_model=Budget(limit=5, phase="backward"))
    assert sizes(result) == [1, 2, 4, 8, 6, 5, 4] and result.chosen == 4 and result.verified
    assert built and set(built) == {"PipelinedUpdate"} and result.meta["update"] == "pipelined"
    assert key_of(cfg, load_config("t5-tiny", from_scratch=True), "cpu")["pipelined_update"]
    recipe = yaml.safe_load(save_to_recipe(result, tmp_path / "mine.yaml").read_text())
    # the recipe trains what was probed: on this CPU device the default would be DeepSpeed's step
    assert recipe["pipelined_update"] is True and recipe["batch_size"] == 4


def test_a_recipe_from_a_probe_names_the_step_only_where_the_default_would_take_another():
    values = _recipe_values
    base = {"model": "t5-3b", "offload": "cpu", "pipelined_update": True}  # the saved probe's own flag: ignored
    assert "pipelined_update" not in values({**base, "device": "cuda", "update": "pipelined"})
    assert values({**base, "device": "cuda", "update": "deepspeed"})["pipelined_update"] is False
    assert values({**base, "device": "cpu", "update": "pipelined"})["pipelined_update"] is True
    assert "pipelined_update" not in values({**base, "device": "cpu", "update": "deepspeed"})


def test_backward_oom_is_reset_and_later_steps_match_a_fresh_engine(tmp_path):
    # small gradient buckets, so that ZeRO-2 reduces (and marks as reduced) layers mid-backward, as on big models
    ds_file = tmp_path / "small-buckets.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 20000}}))
    cfg = probe_config(ds_config=str(ds_file))
    run = start_runtime(cfg)
    config = load_config("t5-tiny", from_scratch=True)
    fixed = worst_case_batch("seq2seq", 2, cfg.data_settings(), config.vocab_size, 0)

    def train_on(engine: Engine) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses = []
        for _ in range(2):
            loss = engine.forward(fixed)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, {k: v.clone() for k, v in engine.module.state_dict().items()}

    probed = ProbeSession(run, say=quiet, on_model=Budget(limit=2, phase="backward"))
    try:
        result = search_batch_size(probed.try_size, verify_steps=1, log=quiet)
        assert probed.rebuilds == 0  # the reset held: no new engine
        after_probe = train_on(probed.engine)
    finally:
        probed.close()
    assert sizes(result) == [1, 2, 4, 3, 1]
    assert [t.oom_phase for t in result.trials if not t.fits] == ["backward", "backward"]

    fresh = ProbeSession(run, say=quiet)  # same seed: the same initial weights
    try:
        for trial in result.trials:  # the same training steps, without the interrupted backwards
            if trial.fits:
                fresh.try_size(trial.batch_size, trial.steps)
        expected = train_on(fresh.engine)
    finally:
        fresh.close()
    assert after_probe[0] == expected[0]
    assert all(torch.equal(after_probe[1][k], expected[1][k]) for k in expected[1])


def test_without_the_reset_zero2_breaks_and_the_engine_is_rebuilt(monkeypatch):
    """Proves the reset is needed (the next backward fails) and that the probe survives by rebuilding."""
    monkeypatch.setattr(Engine, "reset_after_oom", lambda self: None)
    lines: list[str] = []
    result = probe_batch(probe_config(), max_batch=CAP, verify_steps=1, say=lines.append,
                         on_model=Budget(limit=1, phase="backward"))
    assert sizes(result) == [1, 2, 1] and result.verified
    assert result.meta["engine_rebuilds"] == 1
    assert any("Gradient computed twice" in line and "rebuilding the engine, trying 1 again" in line
               for line in lines)


def test_a_non_oom_error_is_raised_and_the_engine_closed(monkeypatch):
    closed = []
    real_close = Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(self), real_close(self)))
    budget = Budget(limit=2, phase="forward", error=ValueError)
    with pytest.raises(ValueError, match="faked"):
        probe_batch(probe_config(), max_batch=CAP, say=quiet, on_model=budget)
    assert len(closed) == 1
    gc.collect()  # the traceback's frames held the model until the exception went
    assert budget.model_freed


def test_size_one_out_of_memory_names_what_to_change():
    with pytest.raises(MemoryBudgetError) as info:
        probe_batch(probe_config(), max_batch=CAP, say=quiet, on_model=Budget(limit=0, phase="forward"))
    message = str(info.value)
    assert "\n" not in message
    for fix in ("batch size 1", "in forward", "--src-len", "--tgt-len", "--max-gpu-memory", "fitone plan"):
        assert fix in message


def test_the_probe_checks_host_ram_before_building_anything(monkeypatch, cache_root):
    # fake only the reading of available RAM (this machine has what it has); the check is the pre-flight's
    from fitone import memory

    built = []
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryBudgetError, match="host RAM too small"):
        probe_batch(probe_config(), max_batch=CAP, say=quiet, on_model=built.append)
    assert built == [] and not cache_root.exists()  # no model, no engine, nothing saved
    # the CLI: the same one line; --no-preflight (the user knows better) probes; --no-expandable-segments
    # is the training flag, taken here too so that the probe matches the run it is for
    argv = ["probe-batch", "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32",
            "--src-len", "8", "--tgt-len", "8", "--max-batch", "2", "--verify-steps", "1", "--no-expandable-segments"]
    rc, _out, err = run_main(argv)
    assert rc == 2 and err.startswith("fitone: error: host RAM too small") and len(err.strip().splitlines()) == 1
    rc, out, err = run_main(argv + ["--no-preflight"])
    assert rc == 0, err
    assert "chosen: 1 (5% margin, verified)" in out and len(list(cache_root.glob("*.json"))) == 1


# -- the CLI ---------------------------------------------------------------------------------------
def test_cli_probes_the_longest_examples_writes_json_plot_and_recipe(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    # sources up to 40 bytes (clipped to --src-len 16), targets of 2 bytes + end-of-sequence
    data.write_text("".join(json.dumps({"source": "s" * n, "target": "ab"}) + "\n" for n in (3, 40, 7, 12)))
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# my recipe\n#   fitone train --recipe mine.yaml\nmodel: t5-tiny\nfrom_scratch: true\n"
                      "batch_size: 32  # per GPU\nprecision: fp32\n")
    out_json, out_png = tmp_path / "probe.json", tmp_path / "probe.png"
    argv = ["probe-batch", "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32",
            "--data", str(data), "--src-len", "16", "--tgt-len", "8", "--max-batch", "4", "--verify-steps", "1",
            "--global-batch", "6", "--prefer-batch", "largest", "--json", str(out_json), "--plot", str(out_png),
            "--save", str(recipe)]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "2 fits: " in shown and "reached max_batch=4" in shown  # decisions as they are made
    assert "chosen: 3 (5% margin, verified)" in shown  # the table
    assert "for --global-batch 6: --batch-size 3 with 2 accumulation steps" in shown

    saved = json.loads(out_json.read_text())
    assert [t["batch_size"] for t in saved["trials"]] == [1, 2, 4, 3, 3] and saved["chosen"] == 3
    # 3 x 2 ran accumulated steps on the probe's engine: two micro-batches a step, as the run will
    assert {k: saved["trials"][-1][k] for k in ("purpose", "accumulation", "fits", "steps")} == \
        {"purpose": "check", "accumulation": 2, "fits": True, "steps": 1}
    assert "3 x 2 checked" in shown
    assert saved["meta"]["worst_case"] == "longest examples"
    assert (saved["meta"]["batch_input_tokens"], saved["meta"]["batch_target_tokens"]) == (16, 3)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    text = recipe.read_text()
    assert text.startswith("# my recipe\n#   fitone train --recipe mine.yaml\n# probe-batch: batch_size 3 = ")
    assert "batch_size: 3  # per GPU\n" in text
    # the --global-batch the choice was made for, which the file lacked: the recipe trains at 3 x 2 as probed
    assert fitone.load_recipe(str(recipe)).values == {"model": "t5-tiny", "from_scratch": True, "batch_size": 3,
                                                      "precision": "fp32", "global_batch": 6}

    assert main(argv[:-2]) == 0  # the same probe again: the saved result, no engine
    assert "reusing the probe saved" in capsys.readouterr().out


@pytest.mark.parametrize("flags, fix", [
    (["--src-len", "0"], "--src-len"),
    (["--max-batch", "0"], "--max-batch"),
    (["--margin", "0.5"], "--margin"),
    (["--margin", "-0.1"], "--margin"),
    (["--max-gpu-memory", "lots"], "--max-gpu-memory"),
    (["--max-gpu-memory", "23GiB"], "--max-gpu-memory"),  # a cap, but this run is on the CPU
    (["--model", "gpt2-tiny", "--seq-len", "1000"], "--seq-len 512"),  # beyond its 512 positions
])
def test_bad_input_is_one_line_naming_the_fix_and_exit_2(flags, fix, capsys):
    argv = ["probe-batch", "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fitone: error: ") and "\n" not in err and fix in err, err


def test_a_cap_larger_than_the_gpu_is_refused(monkeypatch, capsys):
    """Fakes a 24 GiB GPU (this machine has none): device, distributed setup and the GPU's size."""
    from fitone import memory, runtime
    from fitone.runtime import DistInfo

    monkeypatch.setattr(runtime, "resolve_device", lambda cfg: "cuda")
    monkeypatch.setattr(runtime, "init_distributed", lambda device: DistInfo(0, 0, 1))
    monkeypatch.setattr(memory, "gpu_total_bytes", lambda device=None: 24 * 1024**3)
    argv = ["probe-batch", "--model", "t5-tiny", "--from-scratch", "--max-gpu-memory", "80GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "80GiB" in err and "larger than the GPU's 24.0 GiB" in err and "smaller cap" in err


# -- --batch-size auto ----------------------------------------------------------------------------
def test_batch_size_auto_reuses_a_saved_probe_without_building_an_engine(monkeypatch, capsys):
    cfg = probe_config(batch_size="auto", global_batch=12, max_steps=2)
    # 5 x 2 ran accumulated steps: 4 x 3 needs no new check
    saved = ProbeResult(trials=[TrialResult(5, fits=True, step_s=1.0, steps=3, purpose="verify"),
                                TrialResult(5, fits=True, step_s=1.0, steps=3, purpose="check", accumulation=2)],
                        largest_fit=5, chosen=5, margin=0.05, granularity=1, verified=True, best_throughput=5,
                        cap_bytes=None, wall_s=60.0, meta={"model": "t5-tiny", "date": "2026-11-29T12:00:00"})
    save_cached(key_of(cfg, load_config("t5-tiny", from_scratch=True), "cpu"), {"max_batch": 64}, saved)

    def no_probe(*_args, **_kwargs):
        raise AssertionError("the saved probe should have been used")

    monkeypatch.setattr(probe_api, "ProbeSession", no_probe)
    result = fitone.train(cfg)
    assert (result.micro_batch, result.grad_accum) == (4, 3)  # 12 = 4 x 3: the largest divisor <= 5
    assert result.steps == 2
    shown = capsys.readouterr().out
    assert "reusing the probe saved 2026-11-29T12:00:00" in shown
    assert "micro-batch 4 x 3 accumulation steps = --global-batch 12" in shown


def test_batch_size_auto_under_several_ranks_reuses_the_one_gpu_probe_or_says_to_run_one(monkeypatch, cache_root):
    """Fakes the launcher's two ranks (the runtime training hands over); the saved probe and its lookup are real."""
    from fitone.probe.api import batch_size_for_training
    from fitone.runtime import DistInfo

    cfg = probe_config(batch_size="auto", global_batch=20)
    ranks = dataclasses.replace(resolve(cfg), dist=DistInfo(rank=0, local_rank=0, world_size=2))
    with pytest.raises(ConfigError, match="needs a saved one-GPU probe: run `fitone probe-batch`"):
        batch_size_for_training(ranks, ranks.runtime(), say=lambda text: None)
    saved = ProbeResult(trials=[TrialResult(6, fits=True, step_s=1.0, steps=3, purpose="verify")], largest_fit=6,
                        chosen=6, margin=0.05, granularity=1, verified=True, best_throughput=6, cap_bytes=None,
                        wall_s=60.0, meta={"model": "t5-tiny"})
    key = key_of(cfg, load_config("t5-tiny", from_scratch=True), "cpu")
    save_cached(key, {"max_batch": 64}, saved)
    # 5 x 2 a GPU never ran accumulated steps in that probe: not reused, and the ranks cannot check it
    with pytest.raises(ConfigError, match="needs a saved one-GPU probe"):
        batch_size_for_training(ranks, ranks.runtime(), say=lambda text: None)
    saved.trials.append(TrialResult(5, fits=True, step_s=1.0, steps=3, purpose="check", accumulation=2))
    save_cached(key, {"max_batch": 64}, saved)
    assert batch_size_for_training(ranks, ranks.runtime(), say=lambda text: None) == 5  # 20 = 5/GPU x 2 GPUs x 2


def test_batch_size_auto_probes_frees_the_probe_then_trains_the_found_size(monkeypatch, cache_root, capsys):
    budget = Budget(limit=3, phase="forward")
    monkeypatch.setattr(probe_api, "probe_on", functools.partial(probe_api.probe_on, on_model=budget, verify_steps=1,
                                                                    max_batch=CAP))
    train_module = importlib.import_module("fitone.train")  # `fitone.train` is also the function

    loaded_after_probe = []

    def load_model(*args, **kwargs):
        loaded_after_probe.append(budget.model_freed)  # the probe's model must be gone by now
        return real_load_model(*args, **kwargs)

    real_load_model = train_module.load_model
    monkeypatch.setattr(train_module, "load_model", load_model)
    cfg = probe_config(batch_size="auto", max_steps=2)
    result = fitone.train(cfg)
    assert result.micro_batch == 2 and result.steps == 2  # 1, 2, 4 (OOM), 3: floor(3 x 0.95) = 2
    assert loaded_after_probe == [True]
    assert "no saved probe for this model" in capsys.readouterr().out
    key = key_of(cfg, load_config("t5-tiny", from_scratch=True), "cpu")
    assert read_cached(key).chosen == 2  # saved: the next run reuses it


def test_batch_size_auto_loads_the_model_config_once_and_builds_the_runtime_once(monkeypatch, cache_root):
    """One run that probes (with a ceiling: the CPU has no limit to find), then trains: the config and the
    runtime it made first are handed to the preflight, the probe and the model load, and the probe does not
    repeat training's pre-flight. Counted under every fitone module's own name for them."""
    import sys

    from fitone import models, run
    from fitone.plan import preflight as real_preflight

    loads, builds, preflights = [], [], []
    # config_and_notes is what load_config and a run's resolve read a model config through
    real_load, real_build = models.config_and_notes, run.resolve

    def counting_preflight(*args, **kwargs):
        preflights.append(args[0].micro_batch or 1)  # the Run it checks: 1 while 'auto' is unprobed
        return real_preflight(*args, **kwargs)

    def counting_load(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    def counting_build(*args, **kwargs):
        builds.append(args)
        return real_build(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name == "fitone" or name.startswith("fitone."):
            if getattr(module, "config_and_notes", None) is real_load:
                monkeypatch.setattr(module, "config_and_notes", counting_load)
            if getattr(module, "resolve", None) is real_build:
                monkeypatch.setattr(module, "resolve", counting_build)
            if getattr(module, "preflight", None) is real_preflight:
                monkeypatch.setattr(module, "preflight", counting_preflight)
    monkeypatch.setattr(probe_api, "probe_on", functools.partial(probe_api.probe_on, verify_steps=1, max_batch=2))
    result = fitone.train(probe_config(batch_size="auto", max_steps=1))
    assert result.micro_batch == 1 and result.steps == 1  # sizes 1, 2: floor(2 x 0.95) = 1
    assert len(loads) == 1 and len(builds) == 1, (loads, builds)
    # training's, at size 1 before the probe and at the chosen size after it: the probe does not repeat it
    assert preflights == [1, result.micro_batch], preflights


# -- on the CPU ------------------------------------------------------------------------------------
def test_on_the_cpu_a_probe_without_a_ceiling_is_refused_before_building_anything(cache_root):
    # nothing runs out of memory on a CPU the way it does on a GPU: an uncapped search would only time sizes
    # up to 4096 and call the last one the limit
    built = []
    with pytest.raises(ConfigError, match="on the CPU nothing runs out of memory the way a GPU does"):
        probe_batch(probe_config(), say=quiet, on_model=built.append)
    assert built == [] and not cache_root.exists()
    common = ["--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32", "--src-len", "8",
              "--tgt-len", "8"]
    for argv, fix in ((["probe-batch", *common], "cap the probe with --max-batch N"),
                      (["train", *common, "--batch-size", "auto", "--max-steps", "1"], "give --batch-size N")):
        rc, _out, err = run_main(argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert fix in err
    assert not cache_root.exists()


def test_on_the_cpu_the_search_stops_at_the_plans_host_ram_bound(monkeypatch):
    """Fakes only the reading of host RAM: just enough for micro-batch 5 by the plan's count."""
    from fitone import memory
    from fitone.plan import preflight

    cfg = probe_config()
    plans = {b: preflight(resolve(cfg).with_batch(b)) for b in (5, 6)}  # a CPU run keeps its "GPU" side in host RAM too
    need = {b: p.host_export + p.gpu_allocated for b, p in plans.items()}  # the steps' peak and the export's shard
    monkeypatch.setattr(memory, "host_rss_bytes", lambda: 0)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (need[5] + need[6]) // 2)
    lines: list[str] = []
    result = probe_batch(cfg, max_batch=CAP, verify_steps=1, say=lines.append)
    assert max(sizes(result)) == 5 == result.largest_fit and result.chosen == 4
    assert any(f"the search stops at micro-batch 5, the largest the plan fits in host RAM (max_batch was {CAP})"
               in line for line in lines)
    assert result.meta["capped"]  # no size ran out of memory: the bound, not a measured limit


def test_a_capped_probe_is_never_reused_as_a_probe_of_the_card(cache_root):
    key = key_of(probe_config(), load_config("t5-tiny", from_scratch=True), "cpu")
    full = probe_batch(probe_config(), max_batch=CAP, verify_steps=1, say=quiet, on_model=Budget(limit=3))
    assert not full.meta["capped"] and full.chosen == 2  # 4 ran out of memory: the card's limit was found
    lines: list[str] = []
    capped = probe_batch(probe_config(), max_batch=2, verify_steps=1, say=lines.append)  # the notebook's kind
    assert capped.meta["capped"] and capped.chosen == 1 and sizes(capped) == [1, 2, 1]
    assert any("capped at max_batch=2 without running out of memory, so --batch-size auto will not reuse it" in line
               for line in lines)
    # saved beside the full probe, not over it; --batch-size auto takes the full one
    assert capped.meta["cache_file"] != full.meta["cache_file"] and len(list(cache_root.glob("*.json"))) == 2
    assert read_cached(key).chosen == 2
    assert fitone.train(probe_config(batch_size="auto", max_steps=1)).micro_batch == 2
    # with only the capped one saved, --batch-size auto does not take it: it would probe (refused on the CPU)
    Path(full.meta["cache_file"]).unlink()
    with pytest.raises(ConfigError, match="on the CPU nothing runs out of memory"):
        fitone.train(probe_config(batch_size="auto", max_steps=1))
    # nor one saved under the card's key before capped probes had their own (no 'capped' flag)
    capped.meta.pop("capped")
    save_cached(key, {"max_batch": 2, "max_trials": 16, "margin": 0.05, "verify_steps": 1}, capped)
    assert read_cached(key) is not None and read_cached(key, full_only=True) is None
    with pytest.raises(ConfigError, match="on the CPU nothing runs out of memory"):
        fitone.train(probe_config(batch_size="auto", max_steps=1))


# -- the saved results -----------------------------------------------------------------------------
# one setting changed by a replace: the case's name and the change
_REPLACED = {
    "precision": {"precision": "bf16"}, "src_len": {"src_len": 16}, "tgt_len": {"tgt_len": 16},
    "seq_len": {"seq_len": 32}, "activation_checkpointing": {"activation_checkpointing": False},
    "offload": {"offload": "none"},
    "pipelined_update": {"pipelined_update": True},  # its landing chunks on the GPU
    "pipelined_on_gpu": {"pipelined_update": False},  # the default on one GPU; --no-pipelined-update: DeepSpeed's
    "max_gpu_memory": {"max_gpu_memory": "20GiB"}, "expandable_segments": {"expandable_segments": False},
    "pack": {"pack": True}, "data_dir_split": {"data_split": "validation"},
    "hub_config": {"data_config": "subset"},  # a hub dataset's configuration (subset)
    "data_fields": {"source_field": "text"}, "prompt_field": {"prompt_field": "prompt"},
    "optimizer_states": {"optimizer_states": "bf16"},  # its landing chunks in 16 bits (from a bf16 base)
}


def _key_base(change: str, tmp_path, t5_dir: Path, data: Path) -> tuple[Any, Any, str]:
    """The base settings, model config and device a case starts from."""
    t5, gpt = load_config("t5-tiny", from_scratch=True), load_config("gpt2-tiny", from_scratch=True)
    base, config, device = probe_config(data=str(data)), t5, "cpu"
    if change in ("seq_len", "pack"):  # a causal LM's
        base, config = probe_config(data=str(data), seq_len=16), gpt
    if change in ("expandable_segments", "allocator_env", "pipelined_on_gpu", "optimizer_states"):
        device = "cuda"
    if change == "optimizer_states":  # 16-bit states train in bf16 only; on a GPU both run the pipelined update
        base = base.replace(precision="bf16")
    if change in ("tokenizer_files", "model_dir"):
        model_dir = tmp_path / "model"
        shutil.copytree(t5_dir, model_dir)
        base = base.replace(model=str(model_dir), from_scratch=False)
    if change == "data_dir_split":
        (tmp_path / "saved").mkdir()
        (tmp_path / "saved" / "data.arrow").write_bytes(b"rows")
        base = base.replace(data=str(tmp_path / "saved"))
    if change == "data_glob":
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "a.jsonl").write_text(data.read_text())
        base = base.replace(data=str(tmp_path / "shards" / "*.jsonl"))
    if change == "hub_config":
        base = base.replace(data="org/dataset")
    return base, config, device


def _changed_elsewhere(change: str, base: Any, tmp_path, monkeypatch, data: Path) -> Any:
    """The cases that change a file, the environment or a version rather than a setting: the settings after."""
    if change == "allocator_env":  # the user's allocator settings win over the flag
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    elif change == "data_file":
        other = tmp_path / "other.jsonl"
        other.write_text(data.read_text())
        return base.replace(data=str(other))
    elif change == "data_edited":
        data.write_text('{"source": "a longer one", "target": "b", "text": "c", "prompt": "d"}\n')
    elif change == "data_glob":
        (tmp_path / "shards" / "b.jsonl").write_text(data.read_text())
    elif change == "chat_template":
        template = tmp_path / "chat.jinja"
        template.write_text("{{ messages }}")
        return base.replace(chat_template=str(template))
    elif change == "tokenizer_files":  # the worst case is the data as this tokenizer cuts it
        tokenizer_config = Path(base.model) / "tokenizer_config.json"
        tokenizer_config.write_text(tokenizer_config.read_text() + "\n")
    elif change == "model_dir":
        return base.replace(model=str(shutil.copytree(base.model, tmp_path / "model2")))
    elif change == "ds_config":
        ds = tmp_path / "ds.json"
        ds.write_text('{"zero_optimization": {"reduce_bucket_size": 1000}}')
        return base.replace(ds_config=str(ds))
    elif change == "gpu":
        monkeypatch.setattr("fitone.memory.gpu_name", lambda: "NVIDIA H200")
    elif change in ("torch", "transformers", "deepspeed", "fitone"):
        monkeypatch.setattr(importlib.import_module(change), "__version__", "0.0.0-other")
    elif change not in ("model_config", "device"):
        raise AssertionError(f"no such case {change}")
    return base


def _key_change(change: str, tmp_path, monkeypatch, t5_dir: Path) -> tuple[dict, dict]:
    """The probe keys of a base setting and of the same setting with `change` made; each case names one
    thing that decides a trial's memory (ProbeSession: the model it builds, its dtype, checkpointing, the
    engine and its step, the worst-case batch, the allocator and its cap, and the code that runs them)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"source": "a", "target": "b", "text": "c", "prompt": "d"}\n')
    base, config, device = _key_base(change, tmp_path, t5_dir, data)
    before = key_of(base, config, device)
    if change in _REPLACED:
        changed = base.replace(**_REPLACED[change])
    else:
        changed = _changed_elsewhere(change, base, tmp_path, monkeypatch, data)
    changed_config = load_config("t5-small", from_scratch=True) if change == "model_config" else config
    return before, key_of(changed, changed_config, "cuda" if change == "device" else device)


@pytest.mark.parametrize("change", [
    "model_config", "precision", "src_len", "tgt_len", "seq_len", "activation_checkpointing", "offload",
    "pipelined_update", "pipelined_on_gpu", "max_gpu_memory", "expandable_segments", "allocator_env", "pack",
    "data_file", "data_edited", "data_glob", "data_dir_split", "hub_config", "data_fields", "prompt_field",
    "chat_template", "tokenizer_files", "model_dir", "ds_config", "device", "gpu", "torch", "transformers",
    "deepspeed", "fitone", "optimizer_states"])
def test_the_cache_key_changes_with_everything_that_decides_a_trials_memory(change, tmp_path, monkeypatch,
                                                                            tiny_t5_dir):
    """A saved probe reused under another setting would hand --batch-size auto a size measured under, say, a
    bigger cap or unpacked rows: an out-of-memory mid-run. Each case changes one thing; dropping any one
    entry from probe_key (or from its data part) fails its case."""
    before, after = _key_change(change, tmp_path, monkeypatch, tiny_t5_dir)
    assert after != before


def test_the_cache_key_ignores_what_does_not_change_memory():
    config = load_config("t5-tiny", from_scratch=True)
    base = probe_config()
    key = key_of(base, config, "cpu")
    for same in ({"lr": 0.5}, {"seed": 7}, {"batch_size": 64}, {"seq_len": 64}, {"data": "synthetic"},
                 {"max_steps": 5}, {"grad_accum": 4}, {"lr_schedule": "cosine", "warmup_steps": 3},
                 {"delayed_update": True}):  # the delayed update's extra buffer is on the host
        assert key_of(base.replace(**same), config, "cpu") == key, same  # seq_len: not a T5's length
    assert "allocator" not in key or key["allocator"] is None  # no CUDA allocator on the CPU
    on_gpu = key_of(base, config, "cuda")  # the pipelined update is the default on one GPU
    assert on_gpu == key_of(base.replace(pipelined_update=True), config, "cuda") and on_gpu["pipelined_update"]


def test_saved_result_is_reused_only_for_the_same_search_settings():
    key = key_of(probe_config(), load_config("t5-tiny", from_scratch=True), "cpu")
    result = search_batch_size(lambda size, steps: TrialResult(size, fits=size <= 10, step_s=1.0, steps=steps),
                               log=quiet)
    search = {"max_batch": 4096, "max_trials": 16, "margin": 0.05, "verify_steps": 3}
    path = save_cached(key, search, result)
    assert read_cached(key, search).chosen == result.chosen == 9
    assert read_cached(key, {**search, "margin": 0.1}) is None
    assert read_cached(key).meta["cache_file"] == str(path)  # --batch-size auto takes any settings
    path.write_text("{not json")
    assert read_cached(key) is None  # a damaged file is measured again, not an error


def test_save_to_a_new_recipe_writes_the_probed_settings(tmp_path):
    result = search_batch_size(lambda size, steps: TrialResult(size, fits=size <= 20, steps=steps), log=quiet)
    result.meta.update(model="t5-3b", from_scratch=True, data="synthetic", src_len=128, tgt_len=128,
                       precision="fp16", activation_checkpointing=True, offload="cpu", max_gpu_memory="23GiB",
                       device="cuda", gpu="NVIDIA H200", date="2026-11-29T12:00:00")
    path = save_to_recipe(result, tmp_path / "t5-3b.yaml")
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# probe-batch: batch_size 19 = largest fit 20 less a 5% margin (verified); "
                               "t5-3b fp16, src/tgt 128/128")
    values = yaml.safe_load(path.read_text())
    assert values["batch_size"] == 19 and values["max_gpu_memory"] == "23GiB"
    assert fitone.TrainConfig.from_dict(values).batch_size == 19


# -- the throughput choice on real engines -----------------------------------------------------------
@pytest.mark.parametrize("pipelined", [False, True], ids=["deepspeed-step", "pipelined-update"])
def test_accumulated_steps_on_an_engine_built_for_one_are_the_steps_of_one_built_for_them(pipelined):
    """What the probe times as an accumulated step is training's step: the same weights, bit for bit."""
    from conftest import fixed_batch, tiny_engine, weights

    probe_like, trained = tiny_engine(pipelined=pipelined), tiny_engine(grad_accum=3, pipelined=pipelined)
    try:
        with probe_like.accumulating(3) as before_micro_step:
            for n in range(6):  # two optimizer steps of 3 micro-batches each
                before_micro_step(n % 3)
                for engine in (probe_like, trained):
                    engine.backward(engine.forward(fixed_batch(n)))
                    engine.step()
        assert probe_like.ds.global_steps == trained.ds.global_steps == 2
        for engine in (probe_like, trained):
            engine.sync_weights()
        mine, theirs = weights(probe_like), weights(trained)
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        probe_like.backward(probe_like.forward(fixed_batch(6)))  # after it: every step an optimizer step again
        probe_like.step()
        assert probe_like.ds.global_steps == 3 and probe_like.ds.gradient_accumulation_steps() == 1
    finally:
        probe_like.close()
        trained.close()


def test_cli_times_the_candidates_as_accumulated_steps_and_reports_the_choice_in_json(tmp_path, capsys):
    from fitone.probe.choice import TOLERANCE

    out_json = tmp_path / "probe.json"
    argv = ["probe-batch", "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32",
            "--src-len", str(SRC_LEN), "--tgt-len", str(TGT_LEN), "--max-batch", "4", "--verify-steps", "1",
            "--global-batch", "4", "--json", str(out_json)]
    assert main(argv) == 0  # the default: --prefer-batch throughput
    shown = capsys.readouterr().out
    saved = json.loads(out_json.read_text())
    # 1, 2, 4 fit (the ceiling), 3 = floor(4 x 0.95) verified; of 4's divisors up to 3: 2 x 2 and 1 x 4, timed
    timed = [t for t in saved["trials"] if t["purpose"] == "throughput"]
    assert [(t["batch_size"], t["accumulation"], t["steps"]) for t in timed] == [(2, 2, 1), (1, 4, 1)]
    assert all(t["fits"] and t["samples_per_s"] == pytest.approx(4 / t["step_s"]) for t in timed)
    largest, other = timed
    expected = other if other["samples_per_s"] > largest["samples_per_s"] * (1 + TOLERANCE) else largest
    assert (saved["micro_batch"], saved["accumulation"]) == (expected["batch_size"], expected["accumulation"])
    assert (saved["prefer"], saved["global_batch"], saved["chosen"]) == ("throughput", 4, 3)
    micro, accum = saved["micro_batch"], saved["accumulation"]
    assert f"train with: micro-batch {micro} x {accum} accumulation step" in shown  # the table
    assert f"for --global-batch 4: --batch-size {micro} with {accum} accumulation steps" in shown
    assert f"train with --batch-size {micro} (or --batch-size auto" in shown
    assert "timing 2 (micro-batch x accumulation) candidates over 1 steps each: 2 x 2, 1 x 4" in shown


def test_batch_size_auto_trains_at_the_probes_micro_batch_and_accumulation(monkeypatch, tmp_path, capsys):
    """A real tiny CPU run: the probe (a faked OOM above 3: 1, 2, 4 OOM, 3; chosen 2) times 2 x 2 and 1 x 4 for
    --global-batch 4, and training runs at the pair it chose; the next run reuses the saved choice without
    building an engine."""
    monkeypatch.setattr(probe_api, "probe_on", functools.partial(probe_api.probe_on, verify_steps=1, max_batch=CAP,
                                                                    on_model=Budget(limit=3, phase="forward")))
    cfg = probe_config(batch_size="auto", global_batch=4, prefer_batch="throughput", max_steps=2,
                       out=str(tmp_path / "run"))
    result = fitone.train(cfg)
    shown = capsys.readouterr().out
    run = resolve(cfg)
    saved = read_cached(key_of(cfg, load_config("t5-tiny", from_scratch=True), "cpu"), full_only=True,
                        choice=probe_api.choice_key(run))
    assert saved.prefer == "throughput" and [(t.batch_size, t.accumulation) for t in saved.candidates()] == \
        [(2, 2), (1, 4)]
    assert (result.micro_batch, result.grad_accum) == (saved.micro_batch, saved.accumulation)
    assert result.micro_batch * result.grad_accum == 4 and result.steps == 2
    assert (f"--batch-size auto: micro-batch {saved.micro_batch} x {saved.accumulation} accumulation steps = "
            "--global-batch 4 (the most samples/s of 2 timed within the margin: largest fit 3 less a 5% margin is 2)") \
        in shown
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "samples_per_s" in r]
    assert steps and all(r["samples_per_s"] * r["step_s"] == pytest.approx(4) for r in steps)  # 4 samples a step

    def no_probe(*_args, **_kwargs):
        raise AssertionError("the saved choice should have been used")

    monkeypatch.setattr(probe_api, "ProbeSession", no_probe)
    again = fitone.train(cfg.replace(out=None))
    assert (again.micro_batch, again.grad_accum) == (result.micro_batch, result.grad_accum)


def test_the_saved_choice_is_reused_only_for_the_same_preference_and_global_batch(cache_root):
    from fitone.probe.choice import choose_batch

    config = load_config("t5-tiny", from_scratch=True)
    base = probe_config(batch_size="auto", global_batch=8, prefer_batch="throughput")
    key = key_of(base, config, "cpu")
    fake = lambda size, steps, accumulation=1: TrialResult(size, fits=size <= 10, step_s=0.1 * accumulation,  # noqa: E731
                                                           steps=steps, accumulation=accumulation)
    result = search_batch_size(fake, log=quiet)
    choose_batch(result, prefer="throughput", accumulation=base.accumulation, global_batch=8, time_step=fake,
                 log=quiet)
    save_cached(key, {"max_batch": 64, **probe_api.choice_key(resolve(base))}, result)

    def choice(**changes):
        return probe_api.choice_key(resolve(base.replace(**changes)))

    assert read_cached(key, choice=choice()).micro_batch == result.micro_batch
    assert read_cached(key, choice=choice(global_batch=16)) is None  # another global batch: time again
    assert read_cached(key, choice=choice(global_batch=None, grad_accum=2)) is None
    assert read_cached(key, choice=choice(prefer_batch="largest")) is not None  # untimed: any saved search
    assert choice(prefer_batch="largest") == {"prefer": "largest"}
    assert choice() == {"prefer": "throughput", "global_batch": 8, "checked": True}
    before_the_check = {k: v for k, v in choice().items() if k != "checked"}  # saved before the accumulated check
    save_cached(key, {"max_batch": 64, **before_the_check}, result)
    assert read_cached(key, choice=choice()) is None  # probed again
