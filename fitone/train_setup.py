"""The steps of a training run's setup that need nothing of the Trainer but what they are handed: the cheap
checks of the inputs, the data and held-out set, the disk check, the run directory and the restore. Each
returns what it built (fitone.train tells the story in order)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fitone import checkpoint
from fitone.config import TrainConfig
from fitone.data import (ChatFields, Dataset, Rows, chat_tokenizer, data_file, load_dataset, open_data,
                         require_one_batch, resume_position)
from fitone.errors import ConfigError
from fitone.evaluate import HeldOut
from fitone.metrics import MetricsLog
from fitone.models import CAUSAL, SEQ2SEQ, LoadedModel, check_seq_len, load_tokenizer
from fitone.packing import require_exact_packing
from fitone.plan import model_shape
from fitone.rundir import check_checkpoint_room, setup_run_dir
from fitone.run import Run
from fitone.zero2 import low_precision, step_mode

Say = Callable[[str], None]


@dataclass
class Inputs:
    """What the cheap checks opened: the model's tokenizer and the data rows (tokenised once the model is loaded)."""

    tokenizer: Any
    rows: Rows | None
    eval_rows: Rows | None
    eval_fields: tuple[str, ...]  # exact match compares a seq2seq row's second


def check_inputs(run: Run) -> Inputs:
    """Cheap checks of the lengths and the data file (resolve checked the batch arithmetic and --ds-config)."""
    cfg, config, task = run.settings, run.model_config, run.task
    check_seq_len(config, cfg.seq_len, cfg.model)
    if cfg.pack and task == CAUSAL:
        require_exact_packing(config)
    # opened (converted to Arrow once, memory-mapped) and checked now, tokenised after the model; this also
    # refuses --prompt-field and --pack on a seq2seq model
    rows = open_data(cfg.data_settings(), task)
    tokenizer = load_tokenizer(cfg.model, config, from_scratch=cfg.from_scratch)  # a missing one is refused here
    if rows is not None and isinstance(rows.fields, ChatFields):
        chat_tokenizer(tokenizer, cfg.chat_template, rows.source)
    held_out = data_file(cfg.data_settings(), task, split="eval")
    if cfg.eval_every and held_out is None:
        raise ConfigError(f"--eval-every needs held-out data and --data {cfg.data} has none: "
                          "add --eval-data FILE.jsonl")
    # a user's held-out file is read (and so checked) now too; config validation ensured eval_examples > 0
    return Inputs(tokenizer=tokenizer, rows=rows,
                  eval_rows=open_data(cfg.data_settings(), task, split="eval") if cfg.eval_data else None,
                  eval_fields=held_out[1] if held_out else ())


def check_disk(run: Run, resume_from: Path | None) -> None:
    """--save-every's checkpoints must fit the disk under --out: refused from the config, before anything is
    written, rather than a full disk at the first save (an 8B checkpoint is ~112 GB)."""
    cfg = run.settings
    if not (cfg.save_every and cfg.out and cfg.preflight):
        return
    n_params = model_shape(cfg, run.model_config)[0].n_params  # the pre-flight's (cached) meta build
    first = int(checkpoint.read_state(resume_from)["step"]) if resume_from else 0
    # the periodic saves after `first`, and the end's unless the last step was one of them (Trainer._save)
    saves = None if cfg.max_steps is None else (cfg.max_steps // cfg.save_every - first // cfg.save_every
                                                + (cfg.max_steps % cfg.save_every > 0))
    size = checkpoint.checkpoint_bytes(n_params, run.precision, run.mode.states)
    check_checkpoint_room(Path(cfg.out), checkpoint_bytes=size,
                          keep=cfg.keep_checkpoints, save_every=cfg.save_every, overwrite=cfg.overwrite,
                          saves=saves)


def setup_data(run: Run, m: LoadedModel, rows: Rows | None, say: Say) -> Dataset:
    """The training rows, tokenised by the loaded model's tokenizer; what was cut or packed is said."""
    cfg = run.settings
    data = load_dataset(cfg.data_settings(), m.task, m.tokenizer, m.config.vocab_size, rows=rows)
    require_one_batch(data, run.micro_batch, run.world_size)
    if data.truncated:
        limits = (f"--seq-len {cfg.seq_len}" if m.task == CAUSAL
                  else f"--src-len {cfg.src_len} / --tgt-len {cfg.tgt_len}")
        examples = data.packed_from or len(data)
        say(f"{data.truncated} of {examples} examples were longer than {limits} and were "
            "truncated (raise the limits to keep them whole)")
    if data.dropped:
        say(f"{data.dropped} conversations have no assistant tokens within --seq-len {cfg.seq_len} "
            "and were left out (nothing to learn from them)")
    if data.packed_from is not None:
        say(f"packed {data.packed_from} examples into {len(data)} rows of {cfg.seq_len} tokens")
    return data


def setup_held_out(run: Run, m: LoadedModel, inputs: Inputs) -> HeldOut | None:
    """What held-out scoring reads; None where nothing is scored (no examples asked, or not rank 0)."""
    cfg = run.settings
    if cfg.eval_examples == 0:
        return None
    data = load_dataset(cfg.data_settings(), m.task, m.tokenizer, m.config.vocab_size, split="eval",
                        rows=inputs.eval_rows)
    if data is None or not run.is_main:
        return None
    return HeldOut(data=data, examples=cfg.eval_examples,
                   answer_field=inputs.eval_fields[1] if m.task == SEQ2SEQ else None,
                   batch=max(1, min(16, run.micro_batch)), pad_id=m.tokenizer.pad_token_id, tgt_len=cfg.tgt_len)


def step_mode_notes(run: Run) -> list[str]:
    """What the user hears of the optimizer step this run takes, where they did not pick it or picked the
    delayed one."""
    cfg, notes = run.settings, []
    if run.mode.states != "fp32":
        rounded = {"bf16": "stochastically", "bf16-kahan": "to the nearest, what that loses kept in a bf16 "
                   "compensation buffer"}.get(run.mode.states, "to the nearest")
        per_param = 8 + (2 if run.mode.states in low_precision.COMPENSATED else 0)  # + the compensation buffer
        notes.append(f"optimizer states in bf16 (--optimizer-states {run.mode.states}): master weights and Adam's "
                     f"moments, {per_param} B/param on the host, each step computed in fp32 and rounded {rounded}; "
                     "the pipelined update runs it")
    elif run.mode.name == step_mode.PIPELINED and cfg.pipelined_update is None:
        notes.append("optimizer step: the pipelined update (CPU Adam and upload overlapped with the next forward; "
                     "the same arithmetic as DeepSpeed's step, ~1.4x faster); --no-pipelined-update for DeepSpeed's")
    if cfg.delayed_update:
        notes.append(f"delayed parameter update after {cfg.delayed_update_after} plain steps: each step's "
                     "CPU Adam runs while the GPU computes the next step, on weights one update old; it trains "
                     "worse (t5-large: 4.8x the default's loss after 300 steps): prefer --pipelined-update")
    return notes


def restore(run: Run, engine: Any, resume_from: Path | None, say: Say) -> tuple[dict[str, Any], int | None]:
    """The loop's position, and the step resumed from (read now: that checkpoint may be pruned before the
    run ends). Also seeds this run's random draws, or restores the checkpoint's."""
    state = {"step": 0, "epoch": 0, "batch": 0}
    seed(run.settings.seed)  # dropout draws from here on; a resume replaces this with the checkpoint's RNG
    if resume_from is None:
        return state, None
    state = checkpoint.load(engine, resume_from)
    say(f"resumed from {resume_from} (step {state['step']})")
    was = int(state.get("micro_batch", run.micro_batch)) * int(state.get("world_size", 1))
    now = run.micro_batch * run.world_size
    if was != now:  # e.g. a lower --batch-size after an OOM: continue at the same example
        state["epoch"], state["batch"] = resume_position(state["epoch"], state["batch"], was, now)
        say(f"examples per micro-step changed from {was} to {now}: continuing at the same place "
            f"in epoch {state['epoch']}")
    return state, int(state["step"])


def open_run_dir(run: Run, resume_step: int) -> tuple[Path | None, MetricsLog]:
    """--out (set up on rank 0 only) and its metrics log; `resume_step`: 0 for a fresh run."""
    cfg: TrainConfig = run.settings
    out = Path(cfg.out) if cfg.out else None
    if out is None or not run.is_main:
        return out, MetricsLog(None)
    settings = {**cfg.to_dict(), "precision": run.precision}  # the precision it ran, not 'auto'
    return out, setup_run_dir(out, overwrite=cfg.overwrite, settings=settings,
                              report_sinks=cfg.report_sinks, resume_step=resume_step, verbose=cfg.verbose)


def seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)  # fitone draws none, but a model's or user's code may; checkpoints restore it
    torch.manual_seed(value)  # also every CUDA device
