"""`fitone train` on the GPU with nothing but the defaults: the shipped DeepSpeed config (pinned host
buffers, overlap_comm), fp16, activation checkpointing, the pipelined update and a from-scratch model made on
the GPU; and two GPUs under torchrun.
"""

from __future__ import annotations

import importlib
import math
from statistics import mean

import pytest
import torch
from gpu_lane import metrics, needs_cuda, needs_two_gpus, record, run_fitone

from fitone.config import TrainConfig
from fitone.models import load_model
from fitone.train import Trainer

pytestmark = [pytest.mark.gpu, needs_cuda]

STEPS = 30
# gpt2 from its shipped config, on the learnable word pattern of conftest's text_jsonl (ByT5 bytes, ~40
# tokens a row); lr 1e-3 instead of the default 1e-4, so 30 steps from random weights show the loss fall
COMMON = ["--model", "gpt2", "--from-scratch", "--seq-len", "64", "--batch-size", "8", "--lr", "1e-3",
          "--max-steps", str(STEPS), "--eval-examples", "0", "--no-progress", "--seed", "0"]


def falls(losses: list[float]) -> bool:
    return all(math.isfinite(x) for x in losses) and mean(losses[-5:]) < 0.5 * mean(losses[:5])


def test_the_shipped_default_deepspeed_config_trains_on_the_gpu(text_jsonl, tmp_path, monkeypatch):
    built = []  # where and in what the from-scratch model was made, before the engine moved anything

    def load_and_look(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        built.extend({(p.device.type, p.dtype) for p in loaded.model.parameters()})
        return loaded

    # the module: `fitone.train` is also the package's train() function
    monkeypatch.setattr(importlib.import_module("fitone.train"), "load_model", load_and_look)
    cfg = TrainConfig(model="gpt2", from_scratch=True, data=str(text_jsonl), seq_len=64, batch_size=8, lr=1e-3,
                      max_steps=STEPS, eval_examples=0, progress=False, seed=0, out=str(tmp_path / "run"))
    run = Trainer(cfg)  # what fitone.train does, with a look at the engine between setup and the loop
    try:
        run.setup()
        engine = run.engine
        zero = engine.ds_config["zero_optimization"]
        # the lean host layout: DeepSpeed allocates plain host memory and fitone page-locks it in place
        assert zero["overlap_comm"] and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
        assert "fp16" in engine.ds_config and run.mode.name == "pipelined"
        # DeepSpeed took them: its host buffers are pinned and its gradient copies overlap the backward
        opt = engine.optimizer
        assert opt.overlap_comm and engine.host is not None
        # the fp32 masters and the lean layout's 16-bit gradient buffers (the masters keep no fp32 .grad)
        assert all(p.is_pinned() for p in opt.single_partition_of_fp32_groups)
        assert all(g.is_pinned() for g in engine.host.gradients)
        assert built == [("cuda", torch.float16)]  # initialised on the GPU in the engine's dtype
        result = run.train()
    finally:
        run.cleanup()
    record("default_config_trains", losses=result.losses, skipped_steps=result.skipped_steps,
           samples_per_s=result.samples_per_s, peak_gpu_bytes=result.peak_gpu_bytes)
    assert result.steps == STEPS and result.update == "pipelined"
    assert falls(result.losses), result.losses
    assert result.skipped_steps < STEPS // 3  # fp16's loss scale settles in a few steps


@needs_two_gpus
def test_two_gpus_train_through_torchrun(text_jsonl, tmp_path):
    """Two NCCL ranks, one GPU each: DeepSpeed's step (the pipelined update is for one rank), the loss
    averaged over the ranks, one report, each rank's optimizer shard in the checkpoint."""
    out = tmp_path / "ddp"
    proc = run_fitone(tmp_path, "train", *COMMON, "--data", str(text_jsonl), "--save-every", str(STEPS),
                      "--out", str(out), ranks=2, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("TrainResult(") == 1  # only rank 0 reports
    assert "pipelined update" not in proc.stdout + proc.stderr
    losses = [r["loss"] for r in metrics(out)]
    record("two_gpus", losses=losses)
    assert len(losses) == STEPS and falls(losses), losses
    shards = sorted(p.name for p in (out / "checkpoints" / f"step-{STEPS:08d}").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
