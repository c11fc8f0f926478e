"""The training story: setup (run dir, runtime, model, data, engine) -> loop -> export -> cleanup.

`train(cfg)` is what `fitone train` and notebooks call. Every memory-relevant step of the loop is
visible here; each builder of `setup` returns what it built. The run's decisions are fitone.run's (resolved
once), the setup steps train_setup.py's, the model and engine build.py's (shared with the probe), the
process setup runtime.py's, the DeepSpeed specifics engine.py's and zero2/'s, when to stop stop_policy.py's,
the step records step_log.py's, the files checkpoint.py's and metrics.py's, held-out scoring evaluate.py's.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitone import checkpoint, hf_export, memory
from fitone.config import TrainConfig
from fitone.build import build_engine, build_model
from fitone.data import batches, loss_tokens, steps_per_epoch
from fitone.ds_config import build_ds_config
from fitone.engine import Engine
from fitone.errors import MemoryBudgetError, TrainingAborted
from fitone.evaluate import score
from fitone import loss as fused_loss
from fitone.guards import numerics_advice
from fitone.metrics import MetricsLog
from fitone.models import SEQ2SEQ, LoadedModel, load_model, require_model
from fitone import rundir
from fitone.plan import preflight
from fitone.probe.api import batch_size_for_training
from fitone.report import plot_losses
from fitone.rundir import check_run_dir
from fitone.run import Run, resolve
from fitone.runtime import Runtime
from fitone.step_log import StepLog
from fitone.stop_policy import StopPolicy
from fitone.train_setup import (check_disk, check_inputs, open_run_dir, restore, setup_data, setup_held_out,
                                step_mode_notes)
from fitone.units import gib
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


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.started = time.perf_counter()
        self.runtime: Runtime | None = None  # until setup builds it, every rank speaks (_say)
        self.engine: Engine | None = None
        self.loaded: LoadedModel | None = None
        self.metrics = MetricsLog(None)  # the run directory's, once set up
        self.out: Path | None = None
        # signals, NaN/overflow streaks and host RAM; _abort reads it from any point
        self.policy = StopPolicy(save_every=cfg.save_every, max_bad_steps=cfg.max_bad_steps,
                                 host_mem_warn=cfg.host_mem_warn, host_mem_stop=cfg.host_mem_stop,
                                 agree=lambda *flags: self.runtime.agree(*flags), say=self._say)
        self.state: dict[str, Any] = {"step": 0, "epoch": 0, "batch": 0}

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        cfg.check_paths()  # the files the options name, once per run
        require_model(cfg.model)
        # everything a user can get wrong is checked first: a mistake costs no weight loading or engine
        # init, and nothing is written until the run directory is set up at the very end
        self.resume_from = check_run_dir(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite, model=cfg.model)
        # the run's decisions, once: device, ranks, precision, model config, step mode, cap (nothing heavy)
        run = resolve(cfg).with_given_batch()
        self.runtime = runtime = run.runtime()
        self.config = run.model_config
        inputs = check_inputs(run)
        # what the plan can refuse from the config alone (host RAM, the GPU at micro-batch 1) is refused
        # before the runtime starts (DeepSpeed's may first build an op), a probe, the weights or an engine exist;
        # an 'auto' size is checked at 1 here, then at its probed size
        self._preflight(run)
        check_disk(run, self.resume_from)
        note = runtime.start()
        if note:
            self._say(note)
        # an 'auto' batch size is probed first, on its own model copy, before this run's weights load
        if run.batch_is_auto:
            run = run.with_batch(batch_size_for_training(run, runtime, say=self._say))
            self._preflight(run)
        self.micro_batch, self.accum = run.micro_batch, run.accumulation
        self.loaded = self._setup_model(run, inputs.tokenizer)
        self.data = setup_data(run, self.loaded, inputs.rows, self._say)
        self.held_out = setup_held_out(run, self.loaded, inputs)
        self.run = run = run.with_steps(self._total_steps())
        self.total_steps, self.mode = run.total_steps, run.mode
        self.engine = self._setup_engine(run)
        self.state, self.resumed_step = restore(run, self.engine, self.resume_from, self._say)
        self.out, self.metrics = open_run_dir(run, self.state["step"] if self.resume_from else 0)

    def _setup_model(self, run: Run, tokenizer: Any) -> LoadedModel:
        cfg = self.cfg
        loaded, backend = build_model(run, lambda: load_model(cfg.model, from_scratch=cfg.from_scratch, seed=cfg.seed,
                                                              config=run.model_config, tokenizer=tokenizer,
                                                              **run.from_scratch_placement()))
        for note in loaded.notes:  # an LM head added, a vision tower left out
            self._say(note)
        note = fused_loss.note(loaded.model.config, backend, device=run.device, precision=run.precision,
                               enabled=cfg.fused_loss)
        if note:
            self._say(note)
        return loaded

    def _total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        per_epoch = steps_per_epoch(self.data, self.micro_batch, self.runtime.world_size, self.accum)
        return max(1, math.ceil(per_epoch * self.cfg.epochs))

    def _preflight(self, run: Run) -> None:
        """Stop before anything is allocated if the plan says host RAM or the GPU cannot hold the run."""
        if not self.cfg.preflight:
            return
        preflight(run)

    def _setup_engine(self, run: Run) -> Engine:
        engine = build_engine(run, self.loaded.model, build_ds_config(run))
        for note in step_mode_notes(run):
            self._say(note)
        return engine

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg, engine, runtime = self.cfg, self.engine, self.runtime
        assert engine is not None
        samples_per_step = self.micro_batch * self.accum * runtime.world_size
        stream = batches(self.data, self.micro_batch, seed=cfg.seed, pad_id=self.loaded.tokenizer.pad_token_id,
                         rank=runtime.rank, world_size=runtime.world_size, start_epoch=self.state["epoch"],
                         start_batch=self.state["batch"])
        losses, times, lrs, evals = [], [], [], []
        log = StepLog(self.metrics, log_every=cfg.log_every, total_steps=self.total_steps,
                      first_step=self.state["step"], bar=cfg.progress and runtime.is_main)
        peak_rss = memory.host_rss_bytes()
        engine.train_mode()
        try:
            with self.policy:
                while self.state["step"] < self.total_steps:
                    step_loss, tokens, dt = self._step(stream)
                    losses.append(step_loss)
                    times.append(dt)
                    lrs.append(engine.lr)
                    peak_rss = max(peak_rss, memory.host_rss_bytes())
                    log.write(step=self.state["step"], epoch=self.state["epoch"], loss=step_loss, dt=dt,
                              samples=samples_per_step, tokens=tokens * runtime.world_size, engine=engine,
                              peak_rss=peak_rss)
                    self._save_or_stop(step_loss)
                    if cfg.eval_every and self.state["step"] % cfg.eval_every == 0 \
                            and self.state["step"] < self.total_steps:  # the last step's comes after the export
                        self._score(evals)
        finally:
            log.close()
        engine.sync_weights()  # the last step's update, when an overlapped mode still holds it
        if not self.policy.state_is_good:  # ended inside a NaN streak: neither checkpoint nor export those weights
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
            grad_accum=self.accum, world_size=runtime.world_size, precision=self.run.precision,
            skipped_steps=self.policy.bad.total_skipped, quality=quality,
            out_dir=str(self.out) if self.out else None, final_dir=str(final_dir) if final_dir else None,
            resumed_from=self.resumed_step,
            truncated_examples=self.data.truncated, lrs=lrs, evals=evals, update=self.mode.name,
        )

    def _step(self, stream) -> tuple[float, int, float]:
        """One optimizer step = accum micro-batches: the global batch's loss, this rank's loss tokens and the
        step's time; the loop's position moves on."""
        t0 = time.perf_counter()
        step_loss, tokens = 0.0, 0
        for _ in range(self.accum):
            epoch, b, batch = next(stream)
            tokens += loss_tokens(batch, self.loaded.task)
            step_loss += self._micro_step(batch) / self.accum
        step_loss = self.runtime.mean_over_ranks(step_loss)  # the loss of the whole global batch
        if self.runtime.on_gpu:
            torch.cuda.synchronize()  # time the GPU's work, not just its queueing
        self.state.update(step=self.state["step"] + 1, epoch=epoch, batch=b + 1)
        return step_loss, tokens, time.perf_counter() - t0

    def _save_or_stop(self, loss: float) -> None:
        """After each step, what the stop policy decided: stop unsaved, checkpoint, or save and stop."""
        then = self.policy.after_step(self.state["step"], loss, self.engine.last_step_applied)
        if then.numerics:
            self._abort_numerics(then.numerics)
        if then.save:
            self._save()
        if then.stop:
            self._abort(then.stop)

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

    # -- stopping early -------------------------------------------------------------------------
    def _abort(self, why: str) -> None:
        """Checkpoint (when there is a run dir and the state is good) and stop with the way to resume."""
        step = self.state["step"]
        if self.out is None:
            raise TrainingAborted(f"{why} at step {step}; nothing saved (no --out given)")
        if not self.policy.state_is_good:
            raise TrainingAborted(f"{why} at step {step}; not saved, because the last step's loss was NaN/inf"
                                  f"{self._last_good()}")
        path = self._save(stopping=why)
        raise TrainingAborted(f"{why} at step {step}; checkpoint saved to {path}; continue with the same command "
                              "plus --resume")

    def _abort_numerics(self, why: str) -> None:
        """NaN/overflow: stop, keeping the last good checkpoint (the bad state is not saved)."""
        advice = numerics_advice(self.run.precision, getattr(self.loaded.config, "model_type", ""))
        raise TrainingAborted(f"{why} (up to step {self.state['step']}): {advice}{self._last_good()}")

    def _last_good(self) -> str:
        last = checkpoint.latest(self.out) if self.out else None
        return f"; the last good checkpoint is {last}: add --resume to continue from it" if last else ""

    def _save(self, stopping: str | None = None) -> Path | None:
        """This step's checkpoint (the one already written, if any); a save the host or the disk cannot hold is
        not started: the run stops, saying why (in the words of `stopping`, the stop a save was asked for by)."""
        if self.out is None:
            return None
        step = self.state["step"]
        done = checkpoint.checkpoint_root(self.out) / checkpoint.tag_for(step)
        if checkpoint.is_complete(done):  # e.g. the end of a run, or a stop, right after a periodic save
            if stopping:
                self._say(f"{stopping}: the checkpoint of step {step} is already written, stopping")
            return done
        short = self.policy.save_short(checkpoint.save_host_bytes(self.engine)) or _disk_short(
            self.engine, self.run, self.out, self.policy)
        if short:  # stop without the save: killed mid-save, the run would end the same, with less said
            head = f"{stopping} at step {step}; not saved" if stopping else \
                f"stopped at step {step} instead of writing a checkpoint"
            raise TrainingAborted(f"{head}, because {short}{self._last_good()}")
        if stopping:
            self._say(f"{stopping}: saving a checkpoint at step {step}, then stopping (a second Ctrl-C quits at once)")
        import torch.distributed as dist

        state = {**self.state, "model": self.cfg.model, "precision": self.run.precision,
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


def _batch_lengths(batch: dict[str, torch.Tensor], task: str) -> str:
    n, width = batch["input_ids"].shape
    if task == SEQ2SEQ:
        return f"{n} examples x {width} input tokens and {batch['labels'].shape[1]} target tokens"
    return f"{n} examples x {width} tokens"


def _disk_short(engine: Engine, run: Run, out: Path, policy: StopPolicy) -> str | None:
    """Why a checkpoint save now would not fit the disk under --out (None: it fits), the same on every rank."""
    numel = sum(p.numel() for p in engine.module.parameters())
    why = rundir.stop_save_short(out, checkpoint.checkpoint_bytes(numel, run.precision, run.mode.states))
    return why if policy.agree(why is not None)[0] else None
