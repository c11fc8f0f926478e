"""--report-to: TensorBoard gets what metrics.jsonl gets (plus the config), read back with TensorBoard's reader."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import CLI_RUN, cpu_config, run_main

import fitone
from fitone.errors import ConfigError


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_logs_the_same_scalars_as_metrics_jsonl_and_the_config(tmp_path):
    out = tmp_path / "run"
    fitone.train(cpu_config(max_steps=4, eval_every=2, eval_examples=8, out=str(out), report_to="tensorboard"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = _events(out / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    steps = [r for r in records if "loss" in r]
    held_out = [r for r in records if "eval_loss" in r]
    assert len(steps) == 4 and len(held_out) == 2
    for key in ("loss", "lr", "samples_per_s", "tokens_per_s", "step_s", "host_rss_gib"):
        logged = [(e.step, e.value) for e in acc.Scalars(f"train/{key}")]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], key
    for key in ("eval_loss", "token_accuracy", "exact_match"):
        tag = "eval/" + key.removeprefix("eval_")
        assert tag in tags
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == \
            [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in held_out]
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"model": "t5-tiny"' in config_text and '"report_to": "tensorboard"' in config_text


def test_report_to_needs_a_run_dir_and_a_known_name():
    with pytest.raises(ConfigError, match="writes into the run directory: add --out DIR"):
        cpu_config(report_to="tensorboard")
    with pytest.raises(ConfigError, match="--report-to takes tensorboard, wandb .*got 'mlflow'"):
        cpu_config(report_to="mlflow", out="x")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_one_line(tmp_path):
    rc, _, err = run_main(["train", *CLI_RUN, "--max-steps", "1", "--out", str(tmp_path / "run"),
                           "--report-to", "tensorboard,wandb"])
    assert rc == 2
    assert err.strip().splitlines() == ["fitone: error: --report-to wandb needs the wandb package: pip install wandb"]
    assert not (tmp_path / "run").exists()
