"""What the GPU lane's tests share: engines on the GPU built as training builds them, batches, child runs.

The lane (`python -m pytest -m gpu tests/gpu`, tests/README.md) runs only where CUDA is; elsewhere every
test in it is skipped, so the CPU suite and CI count them as skipped.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env

REPO = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the GPU lane (tests/README.md)")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

MODEL = "gpt2"  # 124M parameters from the shipped config: four pipelined-update chunks (fitone.zero2.overlap)
MICRO_BATCH, SEQ_LEN, LR = 4, 64, 1e-3


def gpu_settings(precision: str, **overrides):
    """The TrainConfig the lane's engines are built from: gpt2 from scratch on the GPU, constant lr."""
    from fitone.config import TrainConfig

    values = {"model": MODEL, "from_scratch": True, "precision": precision, "device": "cuda", "seq_len": SEQ_LEN,
              "batch_size": MICRO_BATCH, "lr": LR, "lr_schedule": "constant", "warmup_steps": 0,
              "eval_examples": 0, "progress": False, "seed": 0}
    return TrainConfig(**{**values, **overrides})


def gpu_engine(precision: str, *, pipelined: bool, grad_accum: int = 1, speculative: bool = False,
               gpu_share: float = 0.0):
    """A ZeRO-2 CPU-offload engine on the GPU with the DeepSpeed config training builds there (pinned host
    buffers, overlap_comm, clip 1.0, fp16's dynamic loss scale); `pipelined`: fitone's default step on one
    GPU, else DeepSpeed's own. Seeded weights, no dropout and eager attention, so that two engines given
    the same batches run the same kernels on the same inputs (the fused attention backwards accumulate in
    a varying order) and differ only where their optimizer steps do. `grad_accum` micro-batches a step;
    `speculative`: the pipelined update's Adam during the backward (fitone.zero2.speculative); `gpu_share`: that
    fraction of its Adam chunks stepped on the GPU (fitone.zero2.gpu_adam)."""
    from fitone.ds_config import build_ds_config
    from fitone.engine import Engine
    from fitone.models import build_model, load_config
    from fitone.run import resolve

    cfg = gpu_settings(precision, grad_accum=grad_accum)
    run = resolve(cfg)
    runtime = run.runtime()
    runtime.start()
    # the first engine's runtime made the process group: destroyed at the lane's exit, where NCCL would warn
    atexit.register(runtime.close)
    config = load_config(MODEL, from_scratch=True)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = build_model(config)
    ds = build_ds_config(run.with_batch(MICRO_BATCH).with_steps(100))  # on the lane's GPU
    return Engine(model, ds, pipelined=pipelined, speculative=speculative, gpu_share=gpu_share)


def lm_batch(step: int) -> dict[str, torch.Tensor]:
    """The same causal-LM batch for the same step: tokens drawn from 64 of gpt2's 50,257, so the loss
    falls fast (from ~ln 50257 towards ln 64) and each update moves it by far more than rounding does."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (MICRO_BATCH, SEQ_LEN), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_step(engine, step: int, grad_accum: int = 1) -> float:
    """One optimizer step of `grad_accum` micro-batches (`lm_batch(step)`, then other batches of their own),
    as fitone's loop takes it: the mean loss, read after the step."""
    losses = []
    for micro in range(grad_accum):
        loss = engine.forward(lm_batch(step + 1000 * micro))
        engine.backward(loss)
        engine.step()  # DeepSpeed applies it at the last micro-batch only
        losses.append(loss.detach())
    return float(torch.stack(losses).float().mean().item())


def masters(engine) -> list[torch.Tensor]:
    """A copy of the fp32 master weights on the host (one flat partition per parameter group)."""
    return [p.detach().clone() for p in engine.optimizer.single_partition_of_fp32_groups]


def record(test: str, **values) -> None:
    """Append what a test measured to $FITONE_GPU_LANE_OUT/gpu-lane-measured.jsonl (passing or not), so a
    device call brings the margins back; nothing is written when the variable is unset."""
    folder = os.environ.get("FITONE_GPU_LANE_OUT")
    if folder:
        with open(Path(folder) / "gpu-lane-measured.jsonl", "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


# NVLink multicast off in a child (NCCL NVLink SHARP off, as scripts/gpu_multi_proof.sh sets it)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_fitone(tmp_path: Path, *args: str, ranks: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m fitone ARGS` in a fresh process (under torchrun with `ranks` > 1)."""
    if ranks > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port)]
    else:
        launcher = []
    cmd = [sys.executable, *launcher, "-m", "fitone", *args]
    # the probe cache in tmp_path; OMP_NUM_THREADS as it is: CPU Adam on gpt2 needs the cores
    env = child_env(one_thread=False, FITONE_CACHE_DIR=str(tmp_path / "cache"), **NO_MULTICAST)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, check=False)


def metrics(out: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl (held-out scores left out)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]
