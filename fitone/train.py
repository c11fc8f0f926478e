"""The training story: setup (run dir, device, model, data, engine) -> loop -> export -> cleanup.

`train(cfg)` is what `fitone train` and notebooks call. Every memory-relevant step of the loop is
visible here; the DeepSpeed specifics live in engine.py, the files in checkpoint.py and metrics.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fitone import checkpoint, memory
from fitone.config import TrainConfig
from fitone.data import (ChatFields, Dataset, batches, data_file, load_dataset, loss_tokens, open_data,
                         require_one_batch, resume_position, steps_per_epoch)
from fitone.ds_config import build_ds_config, read_user_config, update_mode
from fitone.engine import DistInfo, Engine, cpu_adam_built, overlap_options, resolve_device, start_runtime
from fitone.errors import ConfigError, MemoryBudgetError, RunDirError, TrainingAborted
from fitone.guards import BadStepStreak, HostMemoryWatch, StopRequest, is_loss_scale_collapse, numerics_advice
from fitone.metrics import MetricsLog, open_sinks
from fitone.models import (CAUSAL, SEQ2SEQ, LoadedModel, check_seq_len, enable_activation_checkpointing, load_config,
                           load_model, task_of)
from fitone.plan import unforeseen_oom
from fitone.units import gib


@dataclass
class TrainResult:
    """What a run did. `steps` is the run's optimizer steps in all, those before a resume included;
    `losses`, `step_times` and `lrs` have one entry per step of this call (after `resumed_from`)."""

    steps: int
    losses: list[float]
    step_times: list[float]
    samples_per_s: float | None
    peak_gpu_bytes: int
    peak_host_rss_bytes: int
    init_s: float
    wall_s: float
    micro_batch: int
    grad_accum: int
    world_size: int
    precision: str
    skipped_steps: int
    quality: dict[str, float] = field(default_factory=dict)
    out_dir: str | None = None
    final_dir: str | None = None
    resumed_from: int | None = None
    truncated_examples: int = 0
    lrs: list[float] = field(default_factory=list)  # learning rate after each optimizer step of this call
    evals: list[dict[str, float]] = field(default_factory=list)  # each held-out score of this call, with its step
    update: str = "deepspeed"  # the optimizer step that ran: deepspeed, pipelined or delayed (ds_config.update_mode)

    def __repr__(self) -> str:  # a notebook shows the summary, not every loss
        return str(self)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        q = ", ".join(f"{k} {v:.3f}" for k, v in self.quality.items())
        resumed = f" (resumed at {self.resumed_from})" if self.resumed_from is not None else ""
        return (f"TrainResult({self.steps} steps{resumed}, loss {_first(self.losses):.4f} -> {_last(self.losses):.4f}, "
                f"{self.samples_per_s or 0:.1f} samples/s, peak GPU {gib(self.peak_gpu_bytes):.1f} GiB, "
                f"host {gib(self.peak_host_rss_bytes):.1f} GiB{', ' + q if q else ''})")

    def plot(self, path: str | Path) -> Path:
        from fitone.report import plot_losses

        return plot_losses(self.losses, path)


def _first(xs: list[float]) -> float:
    return xs[0] if xs else float("nan")


def _last(xs: list[float]) -> float:
    return xs[-1] if xs else float("nan")


def train(cfg: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Fine-tune with DeepSpeed ZeRO-2 (+ CPU offload) in this process. See TrainConfig for options."""
    cfg = cfg.replace(**overrides) if cfg is not None else TrainConfig(**overrides)
    run = Trainer(cfg)
    try:
        run.setup()
        return run.train()
    finally:
        run.cleanup()


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.engine: Engine | None = None
        self.started = time.perf_counter()

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if not cfg.model:
            raise ConfigError("no model given: pass --model NAME_OR_PATH (or --recipe NAME)")
        # everything a user can get wrong is checked first: a mistake costs no weight loading or engine
        # init, and nothing is written until the run directory is set up at the very end
        self.resume_from = self._check_run_dir()
        self.device = resolve_device(cfg)
        self._check_inputs()
        # what the plan can refuse from the config alone (host RAM, the GPU at micro-batch 1) is refused
        # before the runtime (DeepSpeed's may first build an op), a probe, the weights or an engine exist;
        # an 'auto' size is checked at 1 here, then at its probed size
        self._preflight(1 if cfg.batch_size == "auto" else int(cfg.batch_size),
                        int(os.environ.get("WORLD_SIZE", "1")))
        self.dist: DistInfo = start_runtime(cfg, self.device)
        if self.dist.note:
            self._say(self.dist.note)
        # which optimizer step: decided (and a flag it cannot honour refused) before any weights load; the
        # sections it reads do not depend on the micro-batch, which may still be 'auto'
        on_gpu = self.device == "cuda"
        self.update = update_mode(cfg, build_ds_config(cfg, micro_batch=1, on_gpu=on_gpu),
                                  world_size=self.dist.world_size, on_gpu=on_gpu)
        # an 'auto' batch size is probed first, on its own model copy, before this run's weights load
        self.micro_batch = self._resolve_batch_size()
        if cfg.batch_size == "auto":
            self._preflight(self.micro_batch, self.dist.world_size)
        with unforeseen_oom("model build", verbose=cfg.verbose):
            self._setup_model()
        self._setup_data()
        self.accum = cfg.accumulation(self.micro_batch, self.dist.world_size)
        self.total_steps = self._total_steps()
        self._setup_engine()
        self._setup_run_dir()

    def _check_run_dir(self) -> Path | None:
        """Refuse to touch an existing run unless asked; find what to resume. Nothing is written yet."""
        cfg = self.cfg
        if cfg.out is None:
            if cfg.resume:
                raise RunDirError("--resume needs --out: the run directory to continue")
            return None
        out = Path(cfg.out)
        if out.exists() and not out.is_dir():
            raise RunDirError(f"--out {out} is a file: give a directory path")
        if cfg.resume:
            ckpt = checkpoint.latest(out)
            if ckpt is None:
                raise RunDirError(f"nothing to resume in {out}: no complete checkpoint (train with --save-every N "
                                  "to write them), or drop --resume to start fresh")
            saved_model = checkpoint.read_state(ckpt).get("model")
            if saved_model not in (None, cfg.model):
                raise RunDirError(f"{ckpt} is a checkpoint of model {saved_model!r}, not {cfg.model!r}: resume with "
                                  f"--model {saved_model} or use another --out")
            return ckpt
        if out.exists() and any(out.iterdir()):
            if not cfg.overwrite:
                raise RunDirError(f"--out {out} already holds a run: add --resume to continue it, --overwrite to "
                                  "replace it, or choose another directory")
            if not _is_run_dir(out):  # --overwrite deletes the folder: never one that fitone did not write
                raise RunDirError(f"--out {out} holds files that are not a fitone run, and --overwrite would delete "
                                  "them: choose a new or empty directory")
        return None

    def _check_inputs(self) -> None:
        """Cheap checks of the model name, lengths, batch arithmetic, --ds-config and the data file."""
        cfg = self.cfg
        config = load_config(cfg.model, from_scratch=cfg.from_scratch)  # a config only: no weights yet
        task = task_of(config)
        check_seq_len(config, cfg.seq_len, cfg.model)
        if cfg.ds_config:
            read_user_config(cfg.ds_config)
        if cfg.batch_size != "auto":
            cfg.accumulation(int(cfg.batch_size), int(os.environ.get("WORLD_SIZE", "1")))
        # opened (converted to Arrow once, memory-mapped) and checked now, tokenised after the model; this also
        # refuses --prompt-field and --pack on a seq2seq model
        self._rows = open_data(cfg, task)
        if self._rows is not None and isinstance(self._rows.fields, ChatFields):
            from fitone.data import chat_tokenizer
            from fitone.models import load_tokenizer

            chat_tokenizer(load_tokenizer(cfg.model, config), cfg.chat_template, self._rows.source)
        held_out = data_file(cfg, task, split="eval")
        if cfg.eval_every and held_out is None:
            raise ConfigError(f"--eval-every needs held-out data and --data {cfg.data} has none: "
                              "add --eval-data FILE.jsonl")
        self._eval_fields = held_out[1] if held_out else ()  # exact match compares a seq2seq row's second
        # a user's held-out file is read (and so checked) now too; config validation ensured eval_examples > 0
        self._eval_rows = open_data(cfg, task, split="eval") if cfg.eval_data else None

    def _setup_model(self) -> None:
        cfg = self.cfg
        self.loaded: LoadedModel = load_model(cfg.model, from_scratch=cfg.from_scratch, seed=cfg.seed)
        self.loaded.model.config.use_cache = False  # training needs no KV cache; with one, packed rows go unseen
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.loaded.model)

    def _setup_data(self) -> None:
        cfg, m = self.cfg, self.loaded
        self.data: Dataset = load_dataset(cfg, m.task, m.tokenizer, m.config.vocab_size, rows=self._rows)
        self.eval_data = None if cfg.eval_examples == 0 else \
            load_dataset(cfg, m.task, m.tokenizer, m.config.vocab_size, split="eval", rows=self._eval_rows)
        self.pad_id = m.tokenizer.pad_token_id
        require_one_batch(self.data, self.micro_batch, self.dist.world_size)
        if self.data.truncated:
            limits = (f"--seq-len {cfg.seq_len}" if m.task == CAUSAL
                      else f"--src-len {cfg.src_len} / --tgt-len {cfg.tgt_len}")
            examples = self.data.packed_from or len(self.data)
            self._say(f"{self.data.truncated} of {examples} examples were longer than {limits} and were "
                      "truncated (raise the limits to keep them whole)")
        if self.data.dropped:
            self._say(f"{self.data.dropped} conversations have no assistant tokens within --seq-len {cfg.seq_len} "
                      "and were left out (nothing to learn from them)")
        if self.data.packed_from is not None:
            self._say(f"packed {self.data.packed_from} examples into {len(self.data)} rows of {cfg.seq_len} tokens")

    def _resolve_batch_size(self) -> int:
        if self.cfg.batch_size != "auto":
            return int(self.cfg.batch_size)
        from fitone.probe_run import batch_size_for_training

        return batch_size_for_training(self.cfg, say=self._say)

    def _total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        per_epoch = steps_per_epoch(self.data, self.micro_batch, self.dist.world_size, self.accum)
        return max(1, math.ceil(per_epoch * self.cfg.epochs))

    def _preflight(self, micro_batch: int, world_size: int) -> None:
        """Stop before anything is allocated if the plan says host RAM or the GPU cannot hold the run."""
        if not self.cfg.preflight:
            return
        from fitone.plan import preflight

        preflight(self.cfg, micro_batch=micro_batch, world_size=world_size)

    def _setup_engine(self) -> None:
        ds_config = build_ds_config(self.cfg, micro_batch=self.micro_batch, world_size=self.dist.world_size,
                                    total_steps=self.total_steps, on_gpu=self.device == "cuda")
        memory.reset_gpu_peak()
        if self.cfg.offload == "cpu" and not cpu_adam_built():
            self._say("building DeepSpeed's CPU Adam once for this machine "
                      "(~1.5 minutes on 2 cores; cached for later runs)")
        with unforeseen_oom("engine init", verbose=self.cfg.verbose):
            self.engine = Engine(self.loaded.model, ds_config, **overlap_options(self.cfg, self.update))
        if self.update == "pipelined" and self.cfg.pipelined_update is None:
            self._say("optimizer step: the pipelined update (CPU Adam and upload overlapped with the next forward; "
                      "the same arithmetic as DeepSpeed's step, ~1.4x faster); --no-pipelined-update for DeepSpeed's")
        if self.cfg.delayed_update:
            self._say(f"delayed parameter update after {self.cfg.delayed_update_after} plain steps: each step's "
                      "CPU Adam runs while the GPU computes the next step, on weights one update old; it trains "
                      "worse (t5-large: 4.8x the default's loss after 300 steps): prefer --pipelined-update")
        self.state = {"step": 0, "epoch": 0, "batch": 0}
        self.resumed_step: int | None = None  # read now: that checkpoint may be pruned before the run ends
        _seed(self.cfg.seed)  # dropout draws from here on; a resume replaces this with the checkpoint's RNG
        if self.resume_from is not None:
            self.state = checkpoint.load(self.engine, self.resume_from)
            self.resumed_step = int(self.state["step"])
            self._say(f"resumed from {self.resume_from} (step {self.state['step']})")
            was = int(self.state.get("micro_batch", self.micro_batch)) * int(self.state.get("world_size", 1))
            now = self.micro_batch * self.dist.world_size
            if was != now:  # e.g. a lower --batch-size after an OOM: continue at the same example
                self.state["epoch"], self.state["batch"] = resume_position(self.state["epoch"], self.state["batch"],
                                                                           was, now)
                self._say(f"examples per micro-step changed from {was} to {now}: continuing at the same place "
                          f"in epoch {self.state['epoch']}")

    def _setup_run_dir(self) -> None:
        cfg = self.cfg
        self.out = Path(cfg.out) if cfg.out else None
        if self.out is None or not self.dist.is_main:
            self.metrics = MetricsLog(None)
            return
        if cfg.overwrite and self.out.exists():
            shutil.rmtree(self.out)  # _check_run_dir made sure it is a run directory
        self.out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial(self.out)
        (self.out / "config.json").write_text(_json(cfg.to_dict()))
        resume_step = self.state["step"] if self.resume_from else 0
        self.metrics = MetricsLog(self.out / "metrics.jsonl", resume_step=resume_step,
                                  sinks=open_sinks(cfg.report_sinks, self.out, cfg.to_dict(), resume_step=resume_step))

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        samples_per_step = self.micro_batch * self.accum * self.dist.world_size
        stream = batches(self.data, self.micro_batch, seed=cfg.seed, pad_id=self.pad_id, rank=self.dist.rank,
                         world_size=self.dist.world_size, start_epoch=self.state["epoch"],
                         start_batch=self.state["batch"])
        self.bad = BadStepStreak(cfg.max_bad_steps)
        host_watch = HostMemoryWatch(cfg.host_mem_warn, cfg.host_mem_stop, say=self._say)
        losses, times, lrs, evals = [], [], [], []
        bar = self._progress_bar()
        peak_rss = memory.host_rss_bytes()
        engine.ds.train()
        try:
            with StopRequest() as stop:
                while self.state["step"] < self.total_steps:
                    t0 = time.perf_counter()
                    step_loss, tokens = 0.0, 0
                    for _ in range(self.accum):  # one optimizer step = accum micro-batches
                        epoch, b, batch = next(stream)
                        tokens += loss_tokens(batch, self.loaded.task)
                        loss = self._micro_step(batch, epoch, b)
                        step_loss += loss / self.accum
                    step_loss = self._mean_over_ranks(step_loss)  # the loss of the whole global batch
                    if self.device == "cuda":
                        torch.cuda.synchronize()  # time the GPU's work, not just its queueing
                    dt = time.perf_counter() - t0
                    self.state.update(step=self.state["step"] + 1, epoch=epoch, batch=b + 1)
                    losses.append(step_loss)
                    times.append(dt)
                    lrs.append(engine.lr)
                    peak_rss = max(peak_rss, memory.host_rss_bytes())
                    self._log_step(step_loss, dt, samples_per_step, peak_rss, bar, tokens * self.dist.world_size)
                    self._save_or_stop(step_loss, stop, host_watch)
                    if cfg.eval_every and self.state["step"] % cfg.eval_every == 0 \
                            and self.state["step"] < self.total_steps:  # the last step's comes after the export
                        self._score(evals)
        finally:
            if bar is not None:
                bar.close()
        engine.sync_weights()  # the last step's update, when an overlapped mode still holds it
        if not self.bad.state_is_good:  # ended inside a NaN streak: neither checkpoint nor export those weights
            self._abort_numerics("the last step had a NaN/inf loss")
        if cfg.save_every and self.out:
            self._save()  # the end is always resumable when checkpoints were asked for (no-op if just saved)
        final_dir = self._export()
        quality = self._score(evals)
        steady = times[1:] or times  # the first step includes lazy allocations and warm-up
        return TrainResult(
            steps=self.state["step"], losses=losses, step_times=times,
            samples_per_s=samples_per_step / statistics.median(steady) if steady else None,
            peak_gpu_bytes=memory.gpu_peak_bytes(), peak_host_rss_bytes=peak_rss,
            init_s=engine.init_s, wall_s=time.perf_counter() - self.started, micro_batch=self.micro_batch,
            grad_accum=self.accum, world_size=self.dist.world_size, precision=cfg.precision,
            skipped_steps=self.bad.total_skipped, quality=quality, out_dir=str(self.out) if self.out else None,
            final_dir=str(final_dir) if final_dir else None,
            resumed_from=self.resumed_step,
            truncated_examples=self.data.truncated, lrs=lrs, evals=evals, update=self.update,
        )

    def _save_or_stop(self, loss: float, stop: StopRequest, host_watch: HostMemoryWatch) -> None:
        """After each step: a NaN/overflow streak stops without saving; then the periodic checkpoint;
        then a signal or host RAM past its limit saves (unless just saved) and stops."""
        cfg, bad = self.cfg, self.bad
        used = host_watch.check()
        nan_loss, stop_asked, host_full = self._agree(not math.isfinite(loss), stop.requested, used is not None)
        if bad.update(math.nan if nan_loss else loss, self.engine.last_step_applied):
            self._abort_numerics(f"{bad.streak} steps in a row had a NaN/inf loss or skipped their update")
        if cfg.save_every and self.state["step"] % cfg.save_every == 0 and bad.state_is_good:
            self._save()  # never after a NaN/inf loss: those weights may hold NaN
        if stop_asked:
            self._abort(f"stopped by {stop.signal_name or 'a signal to another rank'}")
        if host_full:
            self._abort(f"host RAM {used or memory.host_used_fraction():.0%} used, past the {cfg.host_mem_stop:.0%} "
                        "limit (host_mem_stop), before the kernel's OOM killer would end the run")

    def _mean_over_ranks(self, loss: float) -> float:
        if self.dist.world_size == 1:
            return loss
        import torch.distributed as dist

        value = torch.tensor([loss], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return float(value.item()) / self.dist.world_size

    def _agree(self, *flags: bool) -> list[bool]:
        """The same decisions on every rank: a signal, NaN or full host RAM seen by one rank stops all
        (alone, it would wait in the save's barrier while the others wait in the next step's all-reduce)."""
        if self.dist.world_size == 1:
            return list(flags)
        import torch.distributed as dist

        votes = torch.tensor([float(f) for f in flags], device=self.engine.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return [bool(v) for v in votes.tolist()]

    def _micro_step(self, batch: dict[str, torch.Tensor], epoch: int, b: int) -> float:
        """Forward, backward (ZeRO-2 moves gradients to the host as they are reduced), and the
        optimizer step, which DeepSpeed applies only at the accumulation boundary."""
        engine = self.engine
        try:
            loss = engine.forward(batch)
            engine.backward(loss)
            engine.step()
        except Exception as exc:
            step = self.state["step"] + 1
            if memory.is_oom_error(exc):
                last = checkpoint.latest(self.out) if self.out else None
                kept = (f"; the last checkpoint {last} is intact: continue from it with --resume and the lower "
                        "--batch-size" if last else "")
                raise MemoryBudgetError(
                    f"GPU out of memory at step {step} with --batch-size {self.micro_batch} on a batch of "
                    f"{_batch_lengths(batch, self.loaded.task)}: lower --batch-size, or run "
                    f"`fitone probe-batch` with this --data and these lengths to find a size that fits the longest "
                    f"examples{kept}"
                ) from exc
            if is_loss_scale_collapse(exc):  # fp16: the scaler hit its minimum and still overflowed
                self._abort_numerics(f"the fp16 loss scale fell to its minimum and still overflowed (step {step})")
            raise
        return float(loss.detach().float().item())

    def _log_step(self, loss: float, dt: float, samples_per_step: int, peak_rss: int, bar, tokens: int) -> None:
        engine = self.engine
        record = {
            "step": self.state["step"], "loss": loss, "lr": engine.lr, "step_s": dt,
            "samples_per_s": samples_per_step / dt, "tokens_per_s": tokens / dt,
            "gpu_peak_gib": gib(memory.gpu_peak_bytes()),
            "host_rss_gib": gib(memory.host_rss_bytes()), "epoch": self.state["epoch"],
            "skipped_steps": engine.skipped_steps,
        }
        if engine.loss_scale is not None:
            record["loss_scale"] = engine.loss_scale
        # the first and last steps always: `fitone report` starts and ends where TrainResult does
        step = self.state["step"]
        if step % self.cfg.log_every == 0 or step in (1, self.total_steps):
            self.metrics.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", sps=f"{record['samples_per_s']:.1f}",
                            gpu=f"{record['gpu_peak_gib']:.1f}G", host=f"{gib(peak_rss):.1f}G", refresh=False)

    def _progress_bar(self):
        if not (self.cfg.progress and self.dist.is_main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.state["step"], desc="train", unit="step", dynamic_ncols=True)

    # -- stopping early -------------------------------------------------------------------------
    def _abort(self, why: str) -> None:
        """Checkpoint (when there is a run dir and the state is good) and stop with the way to resume."""
        step = self.state["step"]
        if self.out is None:
            raise TrainingAborted(f"{why} at step {step}; nothing saved (no --out given)")
        if not self.bad.state_is_good:
            raise TrainingAborted(f"{why} at step {step}; not saved, because the last step's loss was NaN/inf"
                                  f"{self._last_good()}")
        self._say(f"{why}: saving a checkpoint at step {step}, then stopping (a second Ctrl-C quits at once)")
        path = self._save()  # a no-op when this step's periodic checkpoint was just written
        raise TrainingAborted(f"{why} at step {step}; checkpoint saved to {path}; continue with the same command "
                              "plus --resume")

    def _abort_numerics(self, why: str) -> None:
        """NaN/overflow: stop, keeping the last good checkpoint (the bad state is not saved)."""
        advice = numerics_advice(self.cfg.precision, getattr(self.loaded.config, "model_type", ""))
        raise TrainingAborted(f"{why} (up to step {self.state['step']}): {advice}{self._last_good()}")

    def _last_good(self) -> str:
        last = checkpoint.latest(self.out) if self.out else None
        return f"; the last good checkpoint is {last}: add --resume to continue from it" if last else ""

    def _save(self) -> Path | None:
        if self.out is None:
            return None
        import torch.distributed as dist

        state = {**self.state, "model": self.cfg.model, "precision": self.cfg.precision,
                 "micro_batch": self.micro_batch, "world_size": self.dist.world_size}
        return checkpoint.save(self.engine, self.out, self.state["step"], state, keep=self.cfg.keep_checkpoints,
                               is_main=self.dist.is_main, barrier=dist.barrier)

    # -- the end --------------------------------------------------------------------------------
    def _export(self) -> Path | None:
        """DIR/final/ on rank 0 (checkpoint.export)."""
        if self.out is None or not self.dist.is_main:
            return None
        return checkpoint.export(self.engine.module, self.loaded.tokenizer, self.out)

    def _score(self, evals: list[dict[str, float]]) -> dict[str, float]:
        """Evaluate now; keep the numbers with their step in `evals` (rank 0 only has any). A held-out score
        that runs out of GPU memory is skipped with a warning: it must not end (or lose) the training."""
        self.engine.sync_weights()  # the scores read the weights: an overlapped mode's pending update lands first
        try:
            quality = self._evaluate()
        except Exception as exc:
            if not memory.is_oom_error(exc):
                raise
            self.engine.module.train()
            memory.free_memory()
            self._say(f"warning: held-out scoring at step {self.state['step']} ran out of GPU memory and was "
                      "skipped; training goes on (fewer --eval-examples or a smaller --batch-size would fit)")
            return {}
        if quality:
            evals.append({"step": self.state["step"], **quality})
        return quality

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """The quality number: exact match of greedy generations (seq2seq) or eval loss (causal)."""
        if self.eval_data is None or self.cfg.eval_examples == 0 or not self.dist.is_main:
            return {}
        from fitone.data import IGNORE_INDEX, collate

        model = self.engine.module
        model.eval()
        n = min(self.cfg.eval_examples, len(self.eval_data))
        examples = self.eval_data.examples[:n]
        tok = self.loaded.tokenizer
        hits, loss_sum, right, counted = 0, 0.0, 0, 0
        size = max(1, min(16, self.micro_batch))  # no larger than the batches training has shown to fit
        for i in range(0, n, size):
            chunk = examples[i:i + size]
            batch = {k: v.to(self.engine.device) for k, v in collate(chunk, self.eval_data.task, self.pad_id).items()}
            out = model(**batch)
            # next-token accuracy with the true prefix given (teacher forcing): moves long before exact match
            labels = batch["labels"][:, 1:] if self.eval_data.task == CAUSAL else batch["labels"]
            guess = out.logits.argmax(-1)[:, : labels.shape[1]] if self.eval_data.task == SEQ2SEQ else \
                out.logits.argmax(-1)[:, :-1]
            mask = labels != IGNORE_INDEX
            right += int((guess == labels)[mask].sum())
            counted += int(mask.sum())
            loss_sum += float(out.loss.float()) * int(mask.sum())  # the model's loss is the chunk's token mean
            if self.eval_data.task == SEQ2SEQ:
                out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     max_new_tokens=self.cfg.tgt_len, do_sample=False, num_beams=1)
                texts = tok.batch_decode(out, skip_special_tokens=True)
                hits += sum(t.strip() == r[self._eval_fields[1]].strip()
                            for t, r in zip(texts, self.eval_data.raw[i:i + size]))
        model.train()
        # per held-out token, so the numbers do not depend on how the examples were chunked
        result = {"eval_loss": loss_sum / max(counted, 1), "token_accuracy": right / max(counted, 1)}
        if self.eval_data.task == SEQ2SEQ:
            result["exact_match"] = hits / n
        self._say("quality on " + f"{n} held-out examples: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
        self.metrics.write({"step": self.state["step"], **result})  # `fitone report` draws it beside the loss
        return result

    def cleanup(self) -> None:
        """Tear the engine down (also after an error) so the process can train again."""
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()  # TensorBoard/W&B files flushed, also after an error
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.loaded = None  # the module and its tokenizer: a notebook's next run needs the memory back
        memory.free_memory()

    def _say(self, text: str) -> None:
        if getattr(self, "dist", None) is None or self.dist.is_main:
            from tqdm.auto import tqdm

            tqdm.write(f"fitone: {text}")


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # fitone draws none, but a model's or user's code may; checkpoints restore it
    torch.manual_seed(seed)  # also every CUDA device


def _is_run_dir(path: Path) -> bool:
    """A directory fitone wrote: metrics, checkpoints, or its config.json (not a model's config.json)."""
    if (path / "metrics.jsonl").is_file() or checkpoint.checkpoint_root(path).is_dir():
        return True
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"max_bad_steps", "save_every", "host_mem_stop"} <= saved.keys()


def _batch_lengths(batch: dict[str, torch.Tensor], task: str) -> str:
    n, width = batch["input_ids"].shape
    if task == SEQ2SEQ:
        return f"{n} examples x {width} input tokens and {batch['labels'].shape[1]} target tokens"
    return f"{n} examples x {width} tokens"


def _json(values: dict[str, Any]) -> str:
    return json.dumps(values, indent=2, default=str)
