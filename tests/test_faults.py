"""Fault injection on real CPU runs (DeepSpeed ZeRO-2 + CPU offload, the tiny T5): signals, NaN losses,
host-memory pressure, a GPU OOM, and resumes that must continue exactly where the run stopped.

What the CPU cannot do is faked and said so at the spot: a GPU OOM is a raised torch.OutOfMemoryError.
NaN losses are injected by a forward hook; signals and host-memory readings are real.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fitone
from fitone import checkpoint
from fitone.data import batches, load_dataset, resume_position
from fitone.errors import TrainingAborted
from fitone.metrics import MetricsLog, read_metrics
from fitone.models import SEQ2SEQ
from fitone.train import Trainer

from conftest import cpu_config
from conftest import CLI_RUN, child_env, run_main  # the CLI helpers, shared

def one_fitone_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fitone:")]
    assert len(lines) == 1, err
    return lines[0]


def signal_after_step(monkeypatch, step: int, sig: signal.Signals) -> None:
    """Send a real signal to this process right after `step` is logged, as a user's Ctrl-C would land."""
    real_write = MetricsLog.write

    def write(self, record):
        real_write(self, record)
        if record["step"] == step:
            signal.raise_signal(sig)

    monkeypatch.setattr(MetricsLog, "write", write)


def hook_model(monkeypatch, make_hook) -> None:
    """Register make_hook(trainer) as a forward hook on the model each Trainer builds."""
    real_setup = Trainer._setup_model

    def setup_model(self, *args):
        loaded = real_setup(self, *args)
        loaded.model.register_forward_hook(make_hook(self))
        return loaded

    monkeypatch.setattr(Trainer, "_setup_model", setup_model)


def metric_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out)]


# -- interruptions ----------------------------------------------------------------------------------
def test_sigterm_checkpoints_says_how_to_resume_and_resume_continues(tmp_path):
    """A real `python -m fitone train` process gets SIGTERM mid-run."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fitone", "train", *CLI_RUN, "--out", str(out),
                             "--save-every", "1000", "--max-steps", "100000"],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and len(metric_steps(out)) >= 2):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no training steps logged in time"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    line = one_fitone_line(err)
    m = re.fullmatch(r"fitone: error: stopped by SIGTERM at step (\d+); checkpoint saved to (\S+); "
                     r"continue with the same command plus --resume", line)
    assert m, line
    step = int(m.group(1))
    assert step >= 2 and checkpoint.latest(out) == Path(m.group(2)) == out / "checkpoints" / checkpoint.tag_for(step)
    assert checkpoint.read_state(Path(m.group(2)))["step"] == step
    assert metric_steps(out)[-1] == step  # the step in flight was finished, not dropped

    resumed = fitone.train(cpu_config(batch_size=4, out=str(out), resume=True, max_steps=step + 2, save_every=1000))
    assert resumed.resumed_from == step and resumed.steps == step + 2 and len(resumed.losses) == 2
    assert metric_steps(out) == list(range(1, step + 3))


def test_second_ctrl_c_during_the_save_exits_at_once_and_corrupts_nothing(tmp_path, monkeypatch):
    """Ctrl-C after step 2, and again while step 2's checkpoint is being written (real SIGINTs)."""
    out = tmp_path / "run"
    signal_after_step(monkeypatch, 2, signal.SIGINT)
    real_fsync = checkpoint._fsync_tree

    def fsync_then_second_ctrl_c(path):
        real_fsync(path)
        if "step-00000002" in str(path):
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(checkpoint, "_fsync_tree", fsync_then_second_ctrl_c)
    rc, _, err = run_main(["train", *CLI_RUN, "--out", str(out), "--save-every", "1", "--max-steps", "50"])
    assert rc == 130
    assert checkpoint.latest(out).name == "step-00000001"  # the save cut short never got a real name
    assert one_fitone_line(err) == (f"fitone: interrupted; the last complete checkpoint is {checkpoint.latest(out)}: "
                                    "continue with the same command plus --resume")
    assert (out / "checkpoints" / ".tmp-step-00000002").is_dir()

    monkeypatch.undo()
    resumed = fitone.train(cpu_config(batch_size=4, out=str(out), resume=True, max_steps=2, save_every=1))
    assert resumed.resumed_from == 1 and resumed.steps == 2 and len(resumed.losses) == 1
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_a_stops_save_that_cannot_fit_the_disk_is_not_started(tmp_path, monkeypatch):
    """SIGTERM after step 2 of a run without --save-every: the stop's save is checked against the free disk
    first (FAKED: the free-disk reading, one byte short of a checkpoint; a test cannot fill a disk). The run
    stops in one line saying why, and leaves no half-written checkpoint (a Mistral-7B run stopped by SIGTERM
    spent 81 s writing a 100 GB checkpoint onto 64 GiB and failed: bench/results/2026-12-02b-gpu/)."""
    from fitone import rundir
    from fitone.models import build_model, load_config

    out = tmp_path / "run"
    need = checkpoint.checkpoint_bytes(sum(p.numel() for p in build_model(load_config("t5-tiny", from_scratch=True))
                                           .parameters()), "fp32")
    monkeypatch.setattr(rundir, "free_disk_bytes", lambda _path: need - 1)
    signal_after_step(monkeypatch, 2, signal.SIGTERM)
    with pytest.raises(TrainingAborted) as info:
        fitone.train(cpu_config(batch_size=4, max_steps=50, out=str(out)))
    assert str(info.value) == (
        f"stopped by SIGTERM at step 2; not saved, because one checkpoint of this model is {need / 2**30:.2f} GiB "
        f"and {out} has {(need - 1) / 2**30:.2f} GiB free (a half-written checkpoint resumes nothing); free disk "
        "space, or give an --out on a larger disk")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


# -- resume restores everything ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def t5_with_dropout(tmp_path_factory) -> Path:
    """The tiny T5 with dropout on, so the loss depends on the RNG state that resume must restore."""
    from transformers import ByT5Tokenizer

    from fitone.models import build_model, load_config

    config = load_config("t5-tiny", from_scratch=True)
    config.dropout_rate = 0.1
    path = tmp_path_factory.mktemp("models") / "t5-dropout"
    build_model(config).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path


@pytest.mark.numeric
@pytest.mark.parametrize("case", ["warmup+linear decay, dropout", "grad accumulation 2, cosine decay"])
def test_resume_after_a_stop_matches_the_uninterrupted_run_step_for_step(case, t5_with_dropout, tmp_path,
                                                                         monkeypatch):
    """Stopped by SIGTERM at step 4 of 8 and resumed with the same --max-steps: each later step has the
    uninterrupted run's learning rate (exactly) and loss (CPU fp32: to 1e-5). The decaying LR proves the
    scheduler state came back, dropout the RNG, the loss the weights, optimizer and data position."""
    common = dict(batch_size=4, max_steps=8, lr_schedule="linear", warmup_steps=3)
    if case.startswith("warmup"):
        common.update(model=str(t5_with_dropout), from_scratch=False)
    else:
        common.update(batch_size=2, grad_accum=2, lr_schedule="cosine")
    straight = fitone.train(cpu_config(**common))
    assert straight.lrs[0] < straight.lrs[2] and straight.lrs[7] < straight.lrs[3]  # warm-up, then decay

    out = tmp_path / "run"
    signal_after_step(monkeypatch, 4, signal.SIGTERM)
    with pytest.raises(TrainingAborted, match="stopped by SIGTERM at step 4; checkpoint saved"):
        fitone.train(cpu_config(**common, out=str(out), save_every=100))
    monkeypatch.undo()
    resumed = fitone.train(cpu_config(**common, out=str(out), save_every=100, resume=True))

    assert resumed.resumed_from == 4 and resumed.steps == 8 and len(resumed.losses) == 4
    assert resumed.lrs == pytest.approx(straight.lrs[4:], rel=1e-12)
    assert resumed.losses == straight.losses[4:]  # exact resume: bit for bit on the CPU
    logged = read_metrics(out)
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert [r["lr"] for r in logged] == pytest.approx(straight.lrs, rel=1e-12)


# -- numerical faults --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_losses_stop_the_run_and_keep_the_last_good_checkpoint(precision, tmp_path, monkeypatch):
    """Losses are NaN from step 4 on (injected by a forward hook). DeepSpeed skips those updates (the
    gradient norm is NaN) and metrics.jsonl counts them; step 4 is a save step, but a state reached
    through a NaN loss is never checkpointed, so step 2's checkpoint is the one kept."""
    def make_hook(trainer):
        def poison(module, args, output):
            if trainer.state["step"] + 1 >= 4:
                output.loss = output.loss * float("nan")
            return output
        return poison

    hook_model(monkeypatch, make_hook)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", *CLI_RUN, "--precision", precision, "--out", str(out), "--save-every", "2",
                           "--max-bad-steps", "3", "--max-steps", "20"])
    assert rc == 1
    line = one_fitone_line(err)
    assert line == (f"fitone: error: 3 steps in a row had a NaN/inf loss or skipped their update (up to step 6): "
                    f"lower --lr or add --warmup-steps, and check the data for broken examples; the last good "
                    f"checkpoint is {out / 'checkpoints' / 'step-00000002'}: add --resume to continue from it")
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002"]
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / "final").exists()
    logged = read_metrics(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] is None for r in logged] == [False] * 3 + [True] * 3
    assert [r["skipped_steps"] for r in logged] == [0, 0, 0, 1, 2, 3]


# -- memory pressure ---------------------------------------------------------------------------------
def test_host_ram_past_the_stop_threshold_checkpoints_and_stops(tmp_path):
    """The real host-RAM reading, against a stop threshold lowered to 2% so that it trips."""
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "host_mem_warn=0.01", "host_mem_stop=0.02", *CLI_RUN, "--out", str(out),
                           "--max-steps", "10"])
    assert rc == 1
    line = one_fitone_line(err)
    assert re.fullmatch(r"fitone: error: host RAM \d+% used, past the 2% limit \(host_mem_stop\), before the "
                        r"kernel's OOM killer would end the run at step 1; checkpoint saved to \S+step-00000001; "
                        r"continue with the same command plus --resume", line), line
    assert checkpoint.latest(out).name == "step-00000001"


def test_host_ram_past_the_warning_threshold_warns_once(capsys):
    result = fitone.train(cpu_config(batch_size=4, max_steps=3, host_mem_warn=0.01, host_mem_stop=1.0))
    assert result.steps == 3
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning: host RAM" in line]
    assert len(warnings) == 1 and "stops at 100%" in warnings[0]


def test_gpu_oom_mid_run_names_the_batch_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    """The OOM is faked (a CPU has no GPU memory to exhaust): a torch.OutOfMemoryError raised in the
    forward pass of step 3, as a batch longer than the probe saw would."""
    def make_hook(trainer):
        def oom(module, args, output):
            if trainer.state["step"] + 1 == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (faked)")
            return output
        return oom

    hook_model(monkeypatch, make_hook)
    out = tmp_path / "run"
    rc, _, err = run_main(["train", *CLI_RUN, "--out", str(out), "--save-every", "1", "--max-steps", "10"])
    assert rc == 2
    line = one_fitone_line(err)
    assert re.fullmatch(r"fitone: error: GPU out of memory at step 3 with --batch-size 4 on a batch of 4 examples x "
                        r"\d+ input tokens and "
                        r"\d+ target tokens: lower --batch-size, or "
                        r"run `fitone probe-batch` with this --data and these lengths .*; the last checkpoint "
                        r"\S+step-00000002 is intact: continue from it with --resume and the lower --batch-size",
                        line), line
    assert checkpoint.latest(out).name == "step-00000002"

    monkeypatch.undo()  # the advice works: a lower --batch-size resumes from that checkpoint
    resumed = fitone.train(cpu_config(batch_size=2, out=str(out), resume=True, max_steps=3, save_every=1))
    assert resumed.resumed_from == 2 and resumed.steps == 3 and len(resumed.losses) == 1 and resumed.micro_batch == 2


def test_a_lower_batch_size_on_resume_continues_at_the_same_example():
    from transformers import ByT5Tokenizer

    data = load_dataset(cpu_config().data_settings(), SEQ2SEQ, ByT5Tokenizer(), 384)
    before = next(batches(data, 4, seed=0, pad_id=0, start_batch=2))[2]["input_ids"]  # examples 8-11
    epoch, start = resume_position(0, 2, 4, 2)
    after = batches(data, 2, seed=0, pad_id=0, start_epoch=epoch, start_batch=start)
    first, second = next(after)[2]["input_ids"], next(after)[2]["input_ids"]
    width = before.shape[1]

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    assert torch.equal(torch.cat([pad(first), pad(second)]), before)
