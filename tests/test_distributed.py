"""ZeRO-2 data parallel on the CPU: two processes under torchrun (gloo), real DeepSpeed engines.

The same `fitone train` command a user runs under `torchrun`/`deepspeed` on several GPUs; here each
rank is a CPU process. Two ranks at micro-batch 8 see, step by step, exactly the two micro-batches one
process accumulates at micro-batch 8 x 2 (tests/data/test_data.py checks the split): each micro-batch's loss is
its own token mean, and ZeRO-2 averages the ranks' gradients as accumulation averages the micro-batches'.
So the two curves are the same arithmetic, summed in another order.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForSeq2SeqLM

import fitone
from conftest import child_env, cpu_config
from tolerance import LINEAR_STEPS, apart, fp32_loss_drift

ARGS = ["--model", "t5-tiny", "--from-scratch", "--data", "sample", "--src-len", "8", "--tgt-len", "48",
        "--precision", "fp32", "--device", "cpu", "--eval-examples", "0", "--no-progress", "--lr", "3e-3",
        "--seed", "0"]


def _torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
    with socket.socket() as sock:  # a free port, so runs in parallel do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "fitone", "train", *ARGS, "--batch-size", "8", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_losses() -> list[float]:
    """One process at the same global batch of 16, as two accumulated micro-batches of 8."""
    result = fitone.train(cpu_config(batch_size=8, grad_accum=2, max_steps=16, seed=0))
    assert result.grad_accum == 2 and result.world_size == 1
    return result.losses


@pytest.mark.numeric
def test_two_ranks_train_like_one_process_at_the_same_global_batch(tmp_path, one_process_losses):
    out = tmp_path / "ddp"
    proc = _torchrun(out, "--max-steps", "16", "--save-every", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("TrainResult(") == 1  # only rank 0 reports
    losses = _losses(out)
    assert len(losses) == 16
    assert losses[-1] < losses[0] * 0.5
    # fp32 rounding from the first step on (an all-reduce sums in another order than accumulation), over
    # the steps where that bound holds for whole runs (tolerance.LINEAR_STEPS)
    n = LINEAR_STEPS
    assert apart(losses[:n], one_process_losses[:n], fp32_loss_drift, first_differing_step=1) == []
    # a bound that tells arithmetic apart: the same 16 examples as one micro-batch (each token weighed over
    # all 16, not over its own 8) is another computation, and falls outside it
    other = fitone.train(cpu_config(batch_size=16, max_steps=n, seed=0)).losses
    assert apart(other, one_process_losses[:n], fp32_loss_drift, first_differing_step=1) != []
    ckpt = out / "checkpoints" / "step-00000016"
    shards = sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    model = AutoModelForSeq2SeqLM.from_pretrained(out / "final")  # rank 0's export loads without DeepSpeed
    assert model.generate(model.dummy_inputs["input_ids"][:1, :4], max_new_tokens=4).shape[0] == 1


def test_two_ranks_resume_with_the_same_world_size(tmp_path):
    straight = tmp_path / "straight"
    assert _torchrun(straight, "--max-steps", "12").returncode == 0
    out = tmp_path / "run"
    assert _torchrun(out, "--max-steps", "6", "--save-every", "6").returncode == 0
    proc = _torchrun(out, "--max-steps", "12", "--save-every", "6", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same steps up to the checkpoint at 6, then fp32 rounding at most from the resumed step on
    assert apart(_losses(out), _losses(straight), fp32_loss_drift, first_differing_step=7) == []


def test_the_docs_deepspeed_command_runs_two_ranks_through_deepspeeds_launcher(tmp_path):
    """docs/multi-gpu.md's `deepspeed --num_gpus N --module fitone train ...` line, as DeepSpeed parses it, then
    DeepSpeed's per-node launcher (what that command runs on this machine) with two CPU ranks: it adds
    `--local_rank=N` to fitone's arguments, which fitone must accept."""
    import base64
    import shlex

    from deepspeed.launcher.runner import parse_args

    page = (Path(__file__).resolve().parent.parent / "docs" / "multi-gpu.md").read_text()
    line = next(x for x in page.splitlines() if x.startswith("deepspeed "))
    parsed = parse_args(shlex.split(line)[1:])
    assert parsed.module and parsed.user_script == "fitone" and parsed.user_args[0] == "train"

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world}", f"--master_port={port}",
           "--module", "fitone", "train", *ARGS, "--batch-size", "8", "--max-steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TrainResult(4 steps") == 1  # rank 0 reports, rank 1 does not
    assert len(_losses(out)) == 4 and (out / "final" / "config.json").is_file()
