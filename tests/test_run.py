"""A run decides once (fitone.run): one `fitone train --batch-size auto` loads the model config and resolves its
precision, device, step mode and GPU cap once each, and builds one DeepSpeed config per engine.

Real engines on the CPU: the probe's (a search with a ceiling, as the CPU has no memory limit to find) and
training's, on the tiny T5 and on a user's own causal LM with a BOS-adding tokenizer and one without, typed as
a user types them (the causal ones with --seq-len, which is refused for a seq2seq model). The counts are taken
by wrapping each decision under every fitone module's own name for it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys

import pytest
import torch

import fitone
import user_models
from conftest import cpu_config
from fitone import config, ds_config, models, runtime, units
from fitone.cli import dispatch
from fitone.engine import Engine
from fitone.errors import ConfigError
from fitone.probe import api as probe_api
from fitone.run import resolve, resolve_planned
from fitone.zero2 import step_mode

# loaded now, so that each holds the real functions under its own names when a test wraps them
for _module in ("fitone.train", "fitone.plan.estimate", "fitone.probe.trial", "fitone.probe.cache"):
    importlib.import_module(_module)


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    """The probe saves its result under the test's own folder, never in ~/.cache."""
    monkeypatch.setenv("FITONE_CACHE_DIR", str(tmp_path / "fitone-cache"))


def count_calls(monkeypatch, real, counted=lambda *args, **kwargs: True) -> list[tuple]:
    """Every call of `real` made through a fitone module's name for it (where `counted` says it counts)."""
    calls: list[tuple] = []

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if counted(*args, **kwargs):
            calls.append(args)
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        held = getattr(module, real.__name__, None) if name == "fitone" or name.startswith("fitone.") else None
        if held is real or getattr(held, "__wrapped__", None) is real:  # or an earlier test's wrapper of it
            monkeypatch.setattr(module, real.__name__, wrapper)
    return calls


def a_cap_decision(value, flag, *args, **kwargs) -> bool:
    # TrainConfig.validate checks the flag's spelling whenever settings are made (and copied); the decision
    # is the parse that the run's cap in bytes comes from
    return flag == "--max-gpu-memory" and sys._getframe(2).f_code.co_name != "validate"


def train_argv(case: str, tmp_path, text_jsonl) -> list[str]:
    common = ["--device", "cpu", "--batch-size", "auto", "--max-steps", "2", "--precision", "auto", "--lr", "3e-3",
              "--eval-examples", "0", "--no-progress", "--seed", "0"]
    if case == "t5":
        return ["train", "--model", "t5-tiny", "--from-scratch", "--src-len", "8", "--tgt-len", "8", *common]
    bos = case == "llama3, BOS"
    model = user_models.model_dir("llama3" if bos else "qwen2", tmp_path / "model", bos=bos)
    return ["train", "--model", str(model), "--data", str(text_jsonl), "--seq-len", "16", *common]


@pytest.mark.parametrize("case", ["t5", "llama3, BOS", "qwen2, no BOS"])
def test_batch_size_auto_decides_each_thing_once_and_builds_one_deepspeed_config_per_engine(case, monkeypatch,
                                                                                            tmp_path, text_jsonl):
    loads = count_calls(monkeypatch, models.config_and_notes)  # the model config: the CLI's checks read the run's
    precisions = count_calls(monkeypatch, config.resolve_precision)  # 'auto' -> fp32 here: one answer
    devices = count_calls(monkeypatch, runtime.resolve_device)  # GPU or CPU, and the checks against it
    modes = count_calls(monkeypatch, step_mode.decide)  # the optimizer step: probe and training take the same
    caps = count_calls(monkeypatch, units.parse_size, a_cap_decision)  # the cap the probe, key and plan read
    ds_builds = count_calls(monkeypatch, ds_config.build_ds_config)  # what each engine is built from
    engines = []
    real_init = Engine.__init__

    def counting_init(self, *args, **kwargs):
        engines.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", counting_init)
    # the CPU has no memory limit for the probe's search to find: training's probe gets a ceiling of 2
    monkeypatch.setattr(probe_api, "probe_on", functools.partial(probe_api.probe_on, verify_steps=1, max_batch=2))
    results = []
    real_train = fitone.train
    monkeypatch.setattr(fitone, "train", lambda cfg: results.append(real_train(cfg)) or results[-1])  # as the CLI
    assert dispatch(train_argv(case, tmp_path, text_jsonl)) == 0
    result, = results
    assert result.micro_batch == 1 and result.steps == 2 and result.precision == "fp32"  # sizes 1, 2: 2 x 0.95
    assert result.losses and all(loss == loss for loss in result.losses)  # real steps, no NaN
    assert len(loads) == 1, loads
    assert len(precisions) == 1, precisions
    assert len(devices) == 1, devices
    assert len(modes) == 1, modes
    assert len(caps) == 1, caps
    assert len(engines) == 2, engines  # the probe's, then training's
    assert len(ds_builds) == len(engines), ds_builds  # one config per engine, none for deciding or planning


def test_a_run_is_frozen_and_its_batch_comes_as_a_new_run(tmp_path):
    run = resolve(cpu_config(batch_size="auto", global_batch=12))
    assert run.batch_is_auto and run.micro_batch is None and run.precision == "fp32" and run.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.micro_batch = 4
    sized = run.with_batch(4)
    assert (sized.micro_batch, sized.accumulation, run.micro_batch) == (4, 3, None)
    assert sized.with_steps(10).total_steps == 10 and sized.total_steps is None
    with pytest.raises(ConfigError, match="--global-batch 12 is not a multiple"):
        run.with_batch(5)
    probe = sized.for_probe()  # as a probe runs: micro-batch 1, every step an optimizer step
    assert (probe.micro_batch, probe.accumulation, probe.world_size) == (1, 1, 1)
    given = resolve(cpu_config(batch_size=6, grad_accum=2)).with_given_batch()
    assert (given.micro_batch, given.accumulation) == (6, 2)


def test_a_planned_run_reads_nothing_of_this_machine():
    """`fitone plan` plans for a card: a GPU unless --device cpu, on --gpus ranks, its 'auto' precision that
    card's (this machine has no GPU, and its distributed env is not touched)."""
    cfg = fitone.TrainConfig(model="t5-tiny", from_scratch=True, max_gpu_memory="20GiB")
    run = resolve_planned(cfg, 2)
    assert (run.device, run.precision, run.world_size, run.cap_bytes) == ("cuda", "fp16", 2, 20 * 1024**3)
    assert run.mode.name == "deepspeed"  # several ranks keep DeepSpeed's step
    assert resolve_planned(cfg.replace(device="cpu", max_gpu_memory=None), 1).precision == "fp32"


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_from_scratch_model_is_built_on_the_gpu_in_the_engines_dtype_and_on_the_cpu_as_its_architecture_builds(
        precision):
    """A GPU run asks load_model for its model on the GPU in the dtype its engine keeps (the GPU lane checks the
    weights land there); a CPU run for the CPU's fp32 build, whose seeded weights the CPU results rest on."""
    cfg = fitone.TrainConfig(model="t5-tiny", from_scratch=True, precision=precision)
    on_gpu = resolve_planned(cfg, 1)
    assert on_gpu.from_scratch_placement() == dict(device="cuda", dtype=on_gpu.weights_dtype)
    assert on_gpu.weights_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    if precision != "fp16":  # DeepSpeed's CPU accelerator refuses fp16
        assert resolve(cpu_config(precision=precision)).from_scratch_placement() == dict(device=None, dtype=None)
