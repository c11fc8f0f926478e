"""--report-to: TensorBoard and W&B get what metrics.jsonl gets (plus the config), read back from the files they
wrote: TensorBoard's event reader; W&B's offline run file decoded with wandb's own protobuf records."""

from __future__ import annotations

import importlib.util
import json
import socket
import struct

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


def test_a_resumed_run_leaves_tensorboard_one_value_per_step_the_one_metrics_jsonl_has(tmp_path):
    """Resumed from step 3 of a run that had logged 6 (killed after its last checkpoint, say), the resumed run
    logs 4-6 again. Its event file starts with a purge at step 4 (SummaryWriter's purge_step), on which
    TensorBoard's reader drops what the older file logged from there: each scalar has one value per step, the
    resumed run's (step_s differs between the two runs, so a leftover would show). The older file itself still
    holds its steps 4-6: readers other than TensorBoard's see them."""
    import shutil

    from fitone import checkpoint
    from fitone.metrics import read_metrics

    out = tmp_path / "run"
    settings = dict(batch_size=4, max_steps=6, save_every=3, keep_checkpoints=5, eval_every=3, eval_examples=4,
                    out=str(out), report_to="tensorboard")
    fitone.train(cpu_config(**settings))
    shutil.rmtree(checkpoint.checkpoint_root(out) / checkpoint.tag_for(6))
    shutil.rmtree(out / "final")
    fitone.train(cpu_config(**settings, resume=True))
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    records = read_metrics(out)
    acc = _events(out / "tensorboard")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "step_s", "host_rss_gib"):
        logged = [(e.step, e.value) for e in acc.Scalars(f"train/{key}")]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], key
    held_out = [r for r in records if "eval_loss" in r]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == \
        [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in held_out] and len(held_out) == 2


def _wandb_records(run_file):
    """The records of an offline run's .wandb file. wandb 0.31 ships no Python reader for it (its old
    wandb.sdk.internal.datastore is gone), so this walks the file's framing, LevelDB's log format (32 KiB blocks,
    7-byte chunk headers: crc, length, type) after W&B's 7-byte file header, and decodes each record with
    wandb's own protobuf message."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B run file (or a new format version)"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill to the block's end
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: one record complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _item_key(item) -> str:
    return "/".join(item.nested_key) or item.key


def _wandb_run(out):
    """(history rows by step, config, final summary) of the one offline W&B run under out/wandb/."""
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, summary = {}, {}, {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            history[row["_step"]] = row
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({_item_key(u): json.loads(u.value_json) for u in updates})
        elif kind == "summary":
            summary.update({_item_key(u): json.loads(u.value_json) for u in record.summary.update})
    return history, config, summary


def _no_wandb_login(tmp_path, monkeypatch):
    """No API key, no WANDB_MODE, and every file W&B writes (logs, cache, settings) under tmp_path, not HOME."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed: pip install wandb")
def test_wandb_offline_logs_the_same_scalars_as_metrics_jsonl_and_the_config(tmp_path, monkeypatch, capsys):
    _no_wandb_login(tmp_path, monkeypatch)  # and no network here: W&B must go offline by itself
    out = tmp_path / "run"
    fitone.train(cpu_config(max_steps=4, eval_every=2, eval_examples=8, out=str(out), report_to="wandb"))
    assert "fitone: W&B runs offline (no W&B API key" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    held_out = [r for r in records if "eval_loss" in r]
    assert len(steps) == 4 and len(held_out) == 2
    history, config, summary = _wandb_run(out)
    for key in ("loss", "lr", "samples_per_s", "tokens_per_s", "step_s", "host_rss_gib"):
        logged = [(step, row[f"train/{key}"]) for step, row in sorted(history.items()) if f"train/{key}" in row]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], key
    for key in ("eval_loss", "token_accuracy", "exact_match"):
        tag = "eval/" + key.removeprefix("eval_")
        logged = [(step, row[tag]) for step, row in sorted(history.items()) if tag in row]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in held_out], key
    assert summary["train/loss"] == pytest.approx(steps[-1]["loss"], rel=1e-6)
    assert config["model"] == "t5-tiny" and config["report_to"] == "wandb"
    assert config["max_steps"] == 4 and config["lr"] == pytest.approx(3e-3)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed: pip install wandb")
def test_wandb_says_nothing_of_its_own_in_a_quiet_run_and_everything_with_verbose(tmp_path, monkeypatch, capfd):
    """Without --verbose a run with --report-to wandb prints fitone's lines only (W&B's ~25: versions, where the
    run is, its history and summary at the end, go); the run is still recorded. With --verbose they are back."""
    import wandb

    _no_wandb_login(tmp_path, monkeypatch)
    monkeypatch.delenv("WANDB_SILENT")  # as a user's shell has it
    wandb.teardown()  # W&B keeps the settings it first read (an earlier test's WANDB_SILENT) for the process
    capfd.readouterr()
    fitone.train(cpu_config(max_steps=2, out=str(tmp_path / "quiet"), report_to="wandb"))
    out, err = capfd.readouterr()
    assert [line for line in (out + err).splitlines() if "wandb" in line.lower()] == [
        f"fitone: W&B runs offline (no W&B API key: WANDB_API_KEY or `wandb login`): sync later with "
        f"`wandb sync {tmp_path / 'quiet' / 'wandb'}/offline-run-*`"]
    history, _config, _summary = _wandb_run(tmp_path / "quiet")
    assert sorted(history) == [1, 2]
    fitone.train(cpu_config(max_steps=2, out=str(tmp_path / "verbose"), report_to="wandb", verbose=True))
    out, err = capfd.readouterr()
    said = [line for line in (out + err).splitlines() if line.startswith("wandb:")]
    assert len(said) > 10 and any("Run summary" in line for line in said)


def test_report_to_needs_a_run_dir_and_a_known_name():
    with pytest.raises(ConfigError, match="writes into the run directory: add --out DIR"):
        cpu_config(report_to="tensorboard")
    with pytest.raises(ConfigError, match="--report-to takes tensorboard, wandb .*got 'mlflow'"):
        cpu_config(report_to="mlflow", out="x")


def test_wandb_without_the_package_is_one_line(tmp_path, monkeypatch):
    # wandb is in the test extra, so its absence is faked: find_spec answers None for it alone
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    _no_wandb_login(tmp_path, monkeypatch)  # should the check break, W&B's files stay under tmp_path
    rc, _, err = run_main(["train", *CLI_RUN, "--max-steps", "1", "--out", str(tmp_path / "run"),
                           "--report-to", "tensorboard,wandb"])
    assert rc == 2
    assert err.strip().splitlines() == ["fitone: error: --report-to wandb needs the wandb package: pip install wandb"]
    assert not (tmp_path / "run").exists()


def test_wandb_mode_goes_offline_without_a_key_or_a_server_and_obeys_wandb_mode(tmp_path, monkeypatch):
    from fitone.metrics import wandb_mode

    _no_wandb_login(tmp_path, monkeypatch)
    assert wandb_mode() == ("offline", "no W&B API key: WANDB_API_KEY or `wandb login`")
    # a key from `wandb login` (netrc), but a server that does not answer: a closed local port
    (tmp_path / "no-netrc").write_text("machine 127.0.0.1\n  login user\n  password " + "0" * 40 + "\n")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert wandb_mode() == ("offline", "127.0.0.1 not reachable")
    with socket.create_server(("127.0.0.1", 0)) as server:  # one that answers: wandb decides (online)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert wandb_mode() == (None, None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == ("disabled", None)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed: pip install wandb")
def test_wandb_online_asked_without_a_key_is_one_line_not_a_prompt(tmp_path, monkeypatch):
    from fitone.metrics import WandbSink

    _no_wandb_login(tmp_path, monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=r"^--report-to wandb: No API key configured.*unset WANDB_MODE to log "
                                          r"offline and `wandb sync` later\)$"):
        WandbSink(tmp_path / "run", {"model": "t5-tiny"}, 0)
