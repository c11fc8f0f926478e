"""The training story: setup (run dir, runtime, model, data, engine) -> loop -> export -> cleanup.

`train(cfg)` is what `fitone train` and notebooks call. Every memory-relevant step of the loop is
visible here; each builder of `setup` returns what it built. The process setup lives in runtime.py, the
DeepSpeed specifics in engine.py and zero2/, the run directory in rundir.py, the files in checkpoint.py
and metrics.py, held-out scoring in evaluate.py.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from fitone import checkpoint, memory
from fitone import hf_export
from fitone.config import TrainConfig
from fitone.data import (ChatFields, Dataset, Rows, batches, data_file, load_dataset, loss_tokens, open_data,
                         require_one_batch, resume_position, steps_per_epoch)
from fitone.ds_config import build_ds_config, read_user_config
from fitone.engine import Engine
from fitone.errors import ConfigError, MemoryBudgetError, TrainingAborted
from fitone.evaluate import HeldOut, score
from fitone import loss as fused_loss
from fitone.guards import BadStepStreak, HostMemoryWatch, StopRequest, numerics_advice
from fitone.metrics import MetricsLog
from fitone.models import (CAUSAL, SEQ2SEQ, LoadedModel, check_seq_len, enable_activation_checkpointing, load_config,
                           load_model, load_tokenizer, require_model, task_of)
from fitone.packing import require_exact_packing
from fitone.plan import unforeseen_oom
from fitone.rundir import check_checkpoint_room, check_run_dir, setup_run_dir
from fitone.runtime import Runtime, build_runtime
from fitone.units import gib
from fitone.zero2 import step_mode
from fitone.zero2.errors import is_loss_scale_collapse


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
    update: str = "deepspeed"  # the optimizer step that ran: deepspeed, pipelined or delayed (zero2.step_mode)

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
    run = Trainer(TrainConfig.with_overrides(cfg, overrides))
    try:
        run.setup()
        return run.train()
    finally:
        run.cleanup()


@dataclass
class _Inputs:
    """What the cheap checks opened: the model's tokenizer and the data rows (tokenised once the model is loaded)."""

    tokenizer: Any
    rows: Rows | None
    eval_rows: Rows | None
    eval_fields: tuple[str, ...]  # exact match compares a seq2seq row's second


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.started = time.perf_counter()
        self.runtime: Runtime | None = None  # until setup builds it, every rank speaks (_say)
        self.engine: Engine | None = None
        self.loaded: LoadedModel | None = None
        self.metrics = MetricsLog(None)  # the run directory's, once set up
        self.out: Path | None = None
        self.bad = BadStepStreak(cfg.max_bad_steps)  # NaN/overflow streaks; _abort reads it from any point
        self.state: dict[str, Any] = {"step": 0, "epoch": 0, "batch": 0}

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        cfg.check_paths()  # the files the options name, once per run
        require_model(cfg.model)
        # everything a user can get wrong is checked first: a mistake costs no weight loading or engine
        # init, and nothing is written until the run directory is set up at the very end
        self.resume_from = check_run_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite, model=cfg.model)
        self.runtime = runtime = build_runtime(cfg)  # the device and world size; nothing heavy started yet
        self.config = load_config(cfg.model, from_scratch=cfg.from_scratch)  # once per run: a config, no weights
        inputs = self._check_inputs(self.config, runtime.world_size)
        # which optimizer step: decided once (and a flag it cannot honour refused) before any weights load
        self.mode = step_mode.for_config(cfg, world_size=runtime.world_size, on_gpu=runtime.on_gpu)
        # what the plan can refuse from the config alone (host RAM, the GPU at micro-batch 1) is refused
        # before the runtime starts (DeepSpeed's may first build an op), a probe, the weights or an engine exist;
        # an 'auto' size is checked at 1 here, then at its probed size
        self._preflight(1 if cfg.batch_size == "auto" else int(cfg.batch_size))
        self._check_disk()
        note = runtime.start()
        if note:
            self._say(note)
        # an 'auto' batch size is probed first, on its own model copy, before this run's weights load
        self.micro_batch = self._resolve_batch_size()
        if cfg.batch_size == "auto":
            self._preflight(self.micro_batch)
        with unforeseen_oom("model build", verbose=cfg.verbose):
            self.loaded = self._setup_model(self.config, inputs.tokenizer)
        self.data = self._setup_data(self.loaded, inputs.rows)
        self.held_out = self._setup_held_out(self.loaded, inputs)
        self.accum = cfg.accumulation(self.micro_batch, runtime.world_size)
        self.total_steps = self._total_steps()
        self.engine = self._setup_engine(self.loaded.model)
        self.state, self.resumed_step = self._restore(self.resume_from)
        self.out, self.metrics = self._setup_run_dir()

    def _check_inputs(self, config: PretrainedConfig, world_size: int) -> _Inputs:
        """Cheap checks of the lengths, batch arithmetic, --ds-config and the data file."""
        cfg = self.cfg
        task = task_of(config)
        check_seq_len(config, cfg.seq_len, cfg.model)
        if cfg.pack and task == CAUSAL:
            require_exact_packing(config)
        if cfg.ds_config:
            read_user_config(cfg.ds_config)
        if cfg.batch_size != "auto":
            cfg.accumulation(int(cfg.batch_size), world_size)
        # opened (converted to Arrow once, memory-mapped) and checked now, tokenised after the model; this also
        # refuses --prompt-field and --pack on a seq2seq model
        rows = open_data(cfg.data_settings(), task)
        tokenizer = load_tokenizer(cfg.model, config, from_scratch=cfg.from_scratch)  # a missing one is refused here
        if rows is not None and isinstance(rows.fields, ChatFields):
            from fitone.data import chat_tokenizer

            chat_tokenizer(tokenizer, cfg.chat_template, rows.source)
        held_out = data_file(cfg.data_settings(), task, split="eval")
        if cfg.eval_every and held_out is None:
            raise ConfigError(f"--eval-every needs held-out data and --data {cfg.data} has none: "
                              "add --eval-data FILE.jsonl")
        # a user's held-out file is read (and so checked) now too; config validation ensured eval_examples > 0
        return _Inputs(tokenizer=tokenizer, rows=rows,
                       eval_rows=open_data(cfg.data_settings(), task, split="eval") if cfg.eval_data else None,
                       eval_fields=held_out[1] if held_out else ())

    def _setup_model(self, config: PretrainedConfig, tokenizer: Any) -> LoadedModel:
        cfg = self.cfg
        loaded = load_model(cfg.model, from_scratch=cfg.from_scratch, seed=cfg.seed, config=config, tokenizer=tokenizer)
        for note in loaded.notes:  # an LM head added, a vision tower left out
            self._say(note)
        loaded.model.config.use_cache = False  # training needs no KV cache; with one, packed rows go unseen
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(loaded.model)
        backend = fused_loss.prepare(loaded.model, device=self.runtime.device, precision=cfg.precision,
                                     enabled=cfg.fused_loss)
        if backend is not None:
            self._say(f"loss: the LM head and cross-entropy fused ({fused_loss.DESCRIPTIONS[backend]}), so no "
                      f"[tokens, vocab] logits are kept; --no-fused-loss for the model's own")
        return loaded

    def _setup_data(self, m: LoadedModel, rows: Rows | None) -> Dataset:
        cfg = self.cfg
        data = load_dataset(cfg.data_settings(), m.task, m.tokenizer, m.config.vocab_size, rows=rows)
        require_one_batch(data, self.micro_batch, self.runtime.world_size)
        if data.truncated:
            limits = (f"--seq-len {cfg.seq_len}" if m.task == CAUSAL
                      else f"--src-len {cfg.src_len} / --tgt-len {cfg.tgt_len}")
            examples = data.packed_from or len(data)
            self._say(f"{data.truncated} of {examples} examples were longer than {limits} and were "
                      "truncated (raise the limits to keep them whole)")
        if data.dropped:
            self._say(f"{data.dropped} conversations have no assistant tokens within --seq-len {cfg.seq_len} "
                      "and were left out (nothing to learn from them)")
        if data.packed_from is not None:
            self._say(f"packed {data.packed_from} examples into {len(data)} rows of {cfg.seq_len} tokens")
        return data

    def _setup_held_out(self, m: LoadedModel, inputs: _Inputs) -> HeldOut | None:
        """What held-out scoring reads; None where nothing is scored (no examples asked, or not rank 0)."""
        cfg = self.cfg
        if cfg.eval_examples == 0:
            return None
        data = load_dataset(cfg.data_settings(), m.task, m.tokenizer, m.config.vocab_size, split="eval",
                            rows=inputs.eval_rows)
        if data is None or not self.runtime.is_main:
            return None
        return HeldOut(data=data, examples=cfg.eval_examples,
                       answer_field=inputs.eval_fields[1] if m.task == SEQ2SEQ else None,
                       batch=max(1, min(16, self.micro_batch)), pad_id=m.tokenizer.pad_token_id, tgt_len=cfg.tgt_len)

    def _resolve_batch_size(self) -> int:
        if self.cfg.batch_size != "auto":
            return int(self.cfg.batch_size)
        from fitone.probe.api import batch_size_for_training

        return batch_size_for_training(self.cfg, self.runtime, self.config, self.mode, say=self._say)

    def _total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        per_epoch = steps_per_epoch(self.data, self.micro_batch, self.runtime.world_size, self.accum)
        return max(1, math.ceil(per_epoch * self.cfg.epochs))

    def _preflight(self, micro_batch: int) -> None:
        """Stop before anything is allocated if the plan says host RAM or the GPU cannot hold the run."""
        if not self.cfg.preflight:
            return
        from fitone.plan import preflight

        preflight(self.cfg, micro_batch=micro_batch, world_size=self.runtime.world_size, config=self.config,
                  mode=self.mode)

    def _check_disk(self) -> None:
        """--save-every's checkpoints must fit the disk under --out: refused from the config, before anything is
        written, rather than a full disk at the first save (an 8B checkpoint is ~112 GB)."""
        cfg = self.cfg
        if not (cfg.save_every and cfg.out and cfg.preflight):
            return
        from fitone.plan import model_shape

        n_params = model_shape(cfg, self.config)[0].n_params  # the pre-flight's (cached) meta build
        first = int(checkpoint.read_state(self.resume_from)["step"]) if self.resume_from else 0
        saves = None if cfg.max_steps is None else (cfg.max_steps - first) // cfg.save_every + 1  # + the end's
        check_checkpoint_room(Path(cfg.out), checkpoint_bytes=checkpoint.checkpoint_bytes(n_params, cfg.precision),
                              keep=cfg.keep_checkpoints, save_every=cfg.save_every, overwrite=cfg.overwrite,
                              saves=saves)

    def _setup_engine(self, model: torch.nn.Module) -> Engine:
        cfg = self.cfg
        ds_config = build_ds_config(cfg, micro_batch=self.micro_batch, world_size=self.runtime.world_size,
                                    total_steps=self.total_steps, on_gpu=self.runtime.on_gpu)
        memory.reset_gpu_peak()
        with unforeseen_oom("engine init", verbose=cfg.verbose):
            engine = Engine(model, ds_config, **self.mode.engine_options())
        if self.mode.name == step_mode.PIPELINED and cfg.pipelined_update is None:
            self._say("optimizer step: the pipelined update (CPU Adam and upload overlapped with the next forward; "
                      "the same arithmetic as DeepSpeed's step, ~1.4x faster); --no-pipelined-update for DeepSpeed's")
        if cfg.delayed_update:
            self._say(f"delayed parameter update after {cfg.delayed_update_after} plain steps: each step's "
                      "CPU Adam runs while the GPU computes the next step, on weights one update old; it trains "
                      "worse (t5-large: 4.8x the default's loss after 300 steps): prefer --pipelined-update")
        return engine

    def _restore(self, resume_from: Path | None) -> tuple[dict[str, Any], int | None]:
        """The loop's position, and the step resumed from (read now: that checkpoint may be pruned before the
        run ends). Also seeds this run's random draws, or restores the checkpoint's."""
        state = {"step": 0, "epoch": 0, "batch": 0}
        _seed(self.cfg.seed)  # dropout draws from here on; a resume replaces this with the checkpoint's RNG
        if resume_from is None:
            return state, None
        state = checkpoint.load(self.engine, resume_from)
        self._say(f"resumed from {resume_from} (step {state['step']})")
        was = int(state.get("micro_batch", self.micro_batch)) * int(state.get("world_size", 1))
        now = self.micro_batch * self.runtime.world_size
        if was != now:  # e.g. a lower --batch-size after an OOM: continue at the same example
            state["epoch"], state["batch"] = resume_position(state["epoch"], state["batch"], was, now)
            self._say(f"examples per micro-step changed from {was} to {now}: continuing at the same place "
                      f"in epoch {state['epoch']}")
        return state, int(state["step"])

    def _setup_run_dir(self) -> tuple[Path | None, MetricsLog]:
        cfg = self.cfg
        out = Path(cfg.out) if cfg.out else None
        if out is None or not self.runtime.is_main:
            return out, MetricsLog(None)
        resume_step = self.state["step"] if self.resume_from else 0
        return out, setup_run_dir(out, overwrite=cfg.overwrite, settings=cfg.to_dict(),
                                  report_sinks=cfg.report_sinks, resume_step=resume_step, verbose=cfg.verbose)

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        runtime = self.runtime
        samples_per_step = self.micro_batch * self.accum * runtime.world_size
        stream = batches(self.data, self.micro_batch, seed=cfg.seed, pad_id=self.loaded.tokenizer.pad_token_id,
                         rank=runtime.rank, world_size=runtime.world_size, start_epoch=self.state["epoch"],
                         start_batch=self.state["batch"])
        host_watch = HostMemoryWatch(cfg.host_mem_warn, cfg.host_mem_stop, say=self._say)
        losses, times, lrs, evals = [], [], [], []
        bar = self._progress_bar()
        peak_rss = memory.host_rss_bytes()
        engine.train_mode()
        try:
            with StopRequest() as stop:
                while self.state["step"] < self.total_steps:
                    t0 = time.perf_counter()
                    step_loss, tokens = 0.0, 0
                    for _ in range(self.accum):  # one optimizer step = accum micro-batches
                        epoch, b, batch = next(stream)
                        tokens += loss_tokens(batch, self.loaded.task)
                        loss = self._micro_step(batch)
                        step_loss += loss / self.accum
                    step_loss = runtime.mean_over_ranks(step_loss)  # the loss of the whole global batch
                    if runtime.on_gpu:
                        torch.cuda.synchronize()  # time the GPU's work, not just its queueing
                    dt = time.perf_counter() - t0
                    self.state.update(step=self.state["step"] + 1, epoch=epoch, batch=b + 1)
                    losses.append(step_loss)
                    times.append(dt)
                    lrs.append(engine.lr)
                    peak_rss = max(peak_rss, memory.host_rss_bytes())
                    self._log_step(step_loss, dt, samples_per_step, peak_rss, bar, tokens * runtime.world_size)
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
            grad_accum=self.accum, world_size=runtime.world_size, precision=cfg.precision,
            skipped_steps=self.bad.total_skipped, quality=quality, out_dir=str(self.out) if self.out else None,
            final_dir=str(final_dir) if final_dir else None,
            resumed_from=self.resumed_step,
            truncated_examples=self.data.truncated, lrs=lrs, evals=evals, update=self.mode.name,
        )

    def _save_or_stop(self, loss: float, stop: StopRequest, host_watch: HostMemoryWatch) -> None:
        """After each step: a NaN/overflow streak stops without saving; then the periodic checkpoint;
        then a signal or host RAM past its limit saves (unless just saved) and stops."""
        cfg, bad = self.cfg, self.bad
        used = host_watch.check()
        nan_loss, stop_asked, host_full = self.runtime.agree(not math.isfinite(loss), stop.requested,
                                                             used is not None)
        if bad.update(math.nan if nan_loss else loss, self.engine.last_step_applied):
            self._abort_numerics(f"{bad.streak} steps in a row had a NaN/inf loss or skipped their update")
        if cfg.save_every and self.state["step"] % cfg.save_every == 0 and bad.state_is_good \
                and not (stop_asked or host_full):  # never after a NaN/inf loss; a stop saves below, if it fits
            self._save()
        if stop_asked:
            self._abort(f"stopped by {stop.signal_name or 'a signal to another rank'}")
        if host_full:
            self._abort(f"host RAM {used or memory.host_used_fraction():.0%} used, past the {cfg.host_mem_stop:.0%} "
                        "limit (host_mem_stop), before the kernel's OOM killer would end the run")

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> float:
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
        if not (self.cfg.progress and self.runtime.is_main):
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
        short = self._save_short()
        if short:  # stop without the save: killed mid-save, the run would end the same, with less said
            raise TrainingAborted(f"{why} at step {step}; not saved, because {short}{self._last_good()}")
        self._say(f"{why}: saving a checkpoint at step {step}, then stopping (a second Ctrl-C quits at once)")
        path = self._save()
        raise TrainingAborted(f"{why} at step {step}; checkpoint saved to {path}; continue with the same command "
                              "plus --resume")

    def _abort_numerics(self, why: str) -> None:
        """NaN/overflow: stop, keeping the last good checkpoint (the bad state is not saved)."""
        advice = numerics_advice(self.cfg.precision, getattr(self.loaded.config, "model_type", ""))
        raise TrainingAborted(f"{why} (up to step {self.state['step']}): {advice}{self._last_good()}")

    def _last_good(self) -> str:
        last = checkpoint.latest(self.out) if self.out else None
        return f"; the last good checkpoint is {last}: add --resume to continue from it" if last else ""

    def _save_short(self) -> str | None:
        """Why a checkpoint save must not start now (None: it fits): the host RAM it takes beyond training's
        (checkpoint.save_host_bytes) is more than is left. The same answer on every rank."""
        need, left = checkpoint.save_host_bytes(self.engine), memory.host_available_bytes()
        if not self.runtime.agree(need > left)[0]:
            return None
        return (f"a checkpoint save needs {gib(need):.2f} GiB of host RAM beyond training's and "
                f"{gib(left):.2f} GiB is left (the kernel's OOM killer would end it half-written); free host memory, "
                "or plan a smaller run with `fitone plan`")

    def _save(self) -> Path | None:
        """This step's checkpoint (the one already written, if any); a save the host cannot hold is not started:
        the run stops, saying why."""
        if self.out is None:
            return None
        done = checkpoint.checkpoint_root(self.out) / checkpoint.tag_for(self.state["step"])
        if checkpoint.is_complete(done):  # e.g. the end of a run right after a periodic save
            return done
        short = self._save_short()
        if short:
            raise TrainingAborted(f"stopped at step {self.state['step']} instead of writing a checkpoint, because "
                                  f"{short}{self._last_good()}")
        import torch.distributed as dist

        state = {**self.state, "model": self.cfg.model, "precision": self.cfg.precision,
                 "micro_batch": self.micro_batch, "world_size": self.runtime.world_size}
        return checkpoint.save(self.engine, self.out, self.state["step"], state, keep=self.cfg.keep_checkpoints,
                               is_main=self.runtime.is_main, barrier=dist.barrier)

    # -- the end --------------------------------------------------------------------------------
    def _export(self) -> Path | None:
        """DIR/final/ on rank 0 (hf_export.export): a plain Hugging Face model dir."""
        if self.out is None or not self.runtime.is_main:
            return None
        return hf_export.export(self.engine.module, self.loaded.tokenizer, self.out, say=self._say)

    def _score(self, evals: list[dict[str, float]]) -> dict[str, float]:
        """Held-out scores now (evaluate.score); kept with their step in `evals` (rank 0 only has any)."""
        quality = score(self.engine, self.loaded.tokenizer, self.held_out, step=self.state["step"], say=self._say,
                        metrics=self.metrics)
        if quality:
            evals.append({"step": self.state["step"], **quality})
        return quality

    def cleanup(self) -> None:
        """Tear the engine down (also after an error) so the process can train again."""
        self.metrics.close()  # TensorBoard/W&B files flushed, also after an error
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.loaded = None  # the module and its tokenizer: a notebook's next run needs the memory back
        memory.free_memory()
        if self.runtime is not None:
            self.runtime.close()

    def _say(self, text: str) -> None:
        if self.runtime is None or self.runtime.is_main:
            from tqdm.auto import tqdm

            tqdm.write(f"fitone: {text}")


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # fitone draws none, but a model's or user's code may; checkpoints restore it
    torch.manual_seed(seed)  # also every CUDA device


def _batch_lengths(batch: dict[str, torch.Tensor], task: str) -> str:
    n, width = batch["input_ids"].shape
    if task == SEQ2SEQ:
        return f"{n} examples x {width} input tokens and {batch['labels'].shape[1]} target tokens"
    return f"{n} examples x {width} tokens"

