"""A resumed run is the uninterrupted run: on the CPU every step after a resume has the same loss and
learning rate bit for bit, and the exported weights are the same bytes (fp32 and bf16, with and without
gradient accumulation, from a checkpoint inside an epoch and from one on an epoch boundary).

Real DeepSpeed ZeRO-2 + CPU-offload runs of the tiny T5 with dropout on, so the continuation depends on
the weights, DeepSpeedCPUAdam's moments and its bias-correction powers, the LR schedule, the data
position and the RNG; held-out scoring runs between steps, as it does in a real run.
"""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cpu_config

import fitone
from fitone import checkpoint
from fitone.data import SAMPLE_EVAL, SAMPLE_TRAIN
from fitone.metrics import read_metrics

STEPS = 120
EXAMPLES = 201  # 50 steps an epoch at 4 examples a step, one example left over (dropped, as in any run)
ON_BOUNDARY, INSIDE = 50, 75  # the end of epoch 0; the middle of epoch 1


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny T5 with dropout 0.1 (the loss then depends on the RNG too), and small data files."""
    from transformers import ByT5Tokenizer

    from fitone.models import build_model, load_config

    root = tmp_path_factory.mktemp("resume")
    config = load_config("t5-tiny", from_scratch=True)
    config.dropout_rate = 0.1
    torch.manual_seed(0)
    build_model(config).save_pretrained(root / "t5-dropout")
    ByT5Tokenizer().save_pretrained(root / "t5-dropout")
    (root / "train.jsonl").write_text("".join(SAMPLE_TRAIN.read_text().splitlines(keepends=True)[:EXAMPLES]))
    (root / "eval.jsonl").write_text("".join(SAMPLE_EVAL.read_text().splitlines(keepends=True)[:4]))
    return {"model": root / "t5-dropout", "train": root / "train.jsonl", "eval": root / "eval.jsonl"}


def run_config(files: dict[str, Path], precision: str, accum: int, out: Path, **overrides):
    values = dict(model=str(files["model"]), from_scratch=False, data=str(files["train"]),
                  eval_data=str(files["eval"]), eval_examples=4, eval_every=25, precision=precision,
                  batch_size=4 // accum, grad_accum=accum, max_steps=STEPS, lr_schedule="linear",
                  warmup_steps=10, save_every=25, keep_checkpoints=10, out=str(out))
    return cpu_config(**{**values, **overrides})


def resume_from(run: Path, step: int, to: Path) -> Path:
    """A copy of `run` as a run stopped right after its checkpoint at `step` would have left it."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "final")
    for ckpt in checkpoint.complete_checkpoints(to):
        if int(ckpt.name.removeprefix(checkpoint.PREFIX)) > step:
            shutil.rmtree(ckpt)
    return to


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine OpenMP's spinning threads make these runs several
    times slower. Both runs of a comparison use the same setting, so it changes nothing they compare."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# fp32 and bf16, with and without accumulation, in two runs rather than four (each is 235 steps)
@pytest.mark.numeric
@pytest.mark.parametrize("precision,accum", [("fp32", 1), ("bf16", 2)], ids=["fp32", "bf16-accumulation-2"])
def test_a_resumed_run_continues_the_uninterrupted_one_bit_for_bit(files, precision, accum, tmp_path, one_thread):
    straight_dir = tmp_path / "straight"
    straight = fitone.train(run_config(files, precision, accum, straight_dir))
    assert straight.steps == STEPS and straight.resumed_from is None
    ckpts = {int(p.name.removeprefix(checkpoint.PREFIX)): checkpoint.read_state(p)
             for p in checkpoint.complete_checkpoints(straight_dir)}
    micro_batches = 50 * accum  # per epoch
    assert ckpts[ON_BOUNDARY]["epoch"] == 0 and ckpts[ON_BOUNDARY]["batch"] == micro_batches  # epoch 0 done
    assert ckpts[INSIDE]["epoch"] == 1 and ckpts[INSIDE]["batch"] == micro_batches // 2
    straight_evals = {e["step"]: e for e in straight.evals}
    assert sorted(straight_evals) == [25, 50, 75, 100, 120]

    for at in (ON_BOUNDARY, INSIDE):
        out = resume_from(straight_dir, at, tmp_path / f"resumed-{at}")
        resumed = fitone.train(run_config(files, precision, accum, out, resume=True))

        assert resumed.resumed_from == at
        assert resumed.steps == STEPS  # the run's steps, not only this call's
        assert f"TrainResult({STEPS} steps (resumed at {at})" in str(resumed)
        assert resumed.losses[0] == straight.losses[at]  # the first step after the resume, exactly
        assert resumed.losses == straight.losses[at:]  # exact float equality: bit for bit
        assert resumed.lrs == straight.lrs[at:]
        assert resumed.evals == [e for s, e in straight_evals.items() if s > at]
        logged = [(r["step"], r["loss"], r["lr"]) for r in read_metrics(out) if "loss" in r]
        assert logged == [(r["step"], r["loss"], r["lr"]) for r in read_metrics(straight_dir) if "loss" in r]
        weights = (out / "final" / "model.safetensors").read_bytes()
        assert weights == (straight_dir / "final" / "model.safetensors").read_bytes()


def test_checkpoints_carry_the_python_numpy_and_torch_random_streams():
    """Nothing in fitone draws from Python's or NumPy's generators, but a model's or a user's code may:
    a resume restores all three streams where the checkpoint was taken."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    buffer = io.BytesIO()
    torch.save(checkpoint.rng_state(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain types: loads without unpickling arbitrary objects
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    checkpoint.set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_quick_resume_continues_bit_for_bit_and_needs_the_adam_replay_and_the_rng(files, precision, tmp_path,
                                                                                    one_thread):
    """The short version of the test above, which a missing replay or RNG restore fails too: 5 steps, resumed
    from step 2. DeepSpeedCPUAdam keeps beta2**t in float32 by multiplying; a fresh one computes pow(0.999, 3)
    at the resumed step 3, which rounds otherwise than 0.999 * 0.999 * 0.999 does (the first step where they part;
    at step 2 they agree), so without fitone's replay (zero2/cpu_adam.py) step 3's bias correction, and so every
    weight after it, differs. Dropout is on: without the RNG restore, step 3 draws other masks."""
    straight_dir = tmp_path / "straight"
    settings = dict(max_steps=5, save_every=2, eval_every=None, lr_schedule="constant", warmup_steps=0, lr=1e-3)
    straight = fitone.train(run_config(files, precision, 1, straight_dir, **settings))
    out = resume_from(straight_dir, 2, tmp_path / "resumed")
    resumed = fitone.train(run_config(files, precision, 1, out, resume=True, **settings))
    assert resumed.resumed_from == 2 and resumed.losses == straight.losses[2:]
    weights = (out / "final" / "model.safetensors").read_bytes()
    assert weights == (straight_dir / "final" / "model.safetensors").read_bytes()
