"""The tool comparison's HF Trainer runs: Seq2SeqTrainer with `deepspeed=` fitone's config, at a fixed batch size
or with its auto_find_batch_size. Each measure_* runs in a child of scripts/bench_tools.py."""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable, Iterator

from _tools_child import (PARTIAL, build_on_cpu, cap_memory, emit, failure_fields, gpu_peaks, host_peak_gib,
                          load_cpu_adam, loss_fields, make_batch, summarise, syncer, train_config)
from _tools_split import capture_engines


def hf_trainer(job: dict[str, Any], size: int, max_steps: int, callbacks: list, auto_find: bool, workdir: str):
    """A Seq2SeqTrainer over synthetic batches with `deepspeed=` fitone's config dict, set up the way its
    docs show (batch keys 'auto', so TrainingArguments fill them)."""
    import dataclasses

    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from fitone.ds_config import build_ds_config
    from fitone.run import resolve_planned

    model, config, params, _ = build_on_cpu(job, checkpointing=False)  # the Trainer switches it on
    cfg = train_config(job, size)
    ds = build_ds_config(resolve_planned(cfg, 1).with_batch(size))
    ds.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
    names = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    kwargs = dict(
        output_dir=workdir, per_device_train_batch_size=size, max_steps=max_steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        fp16=job["precision"] == "fp16", bf16=job["precision"] == "bf16", report_to="none", save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, deepspeed=ds,
        seed=job["seed"], auto_find_batch_size=auto_find, remove_unused_columns=False,
        use_cpu=job["device"] == "cpu",
        **{ckpt: job["activation_checkpointing"], f"{ckpt}_kwargs": {"use_reentrant": False}},
    )
    args = Seq2SeqTrainingArguments(**{k: v for k, v in kwargs.items() if k in names})  # older/newer names
    rows = make_batch(job, config, size, "cpu")
    dataset = RepeatRows(rows, size * (max_steps + 2))
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.dropped_args = sorted(k for k in kwargs if k not in names)
    return trainer, params


class RepeatRows:
    """A map-style dataset cycling the rows of one batch (the default collator stacks them back)."""

    def __init__(self, batch: dict[str, Any], length: int):
        self.batch, self.length = batch, length
        self.rows = next(iter(batch.values())).shape[0]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i % self.rows] for k, v in self.batch.items()}


def step_timer_callback(sync: Callable[[], None], on_begin: Callable[[Any], None] | None = None):
    """A TrainerCallback recording each optimizer step's synchronised wall time."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.first_step_at: float | None = None
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            if on_begin:
                on_begin(args)

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._t0 = time.perf_counter()
            if self.first_step_at is None:
                self.first_step_at = self._t0

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def measure_hf_trainer(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    (size,) = job["sizes"]
    warm, timed, extra = job["warmup"], job["steps"], job["split_steps"]
    sync = syncer(job["device"])
    op_load_s = load_cpu_adam()
    cap_memory(job)
    timer = step_timer_callback(sync)
    with tempfile.TemporaryDirectory() as workdir, capture_engines(sync, warm + timed if extra else None) as splits:
        t0 = time.perf_counter()
        trainer, params = hf_trainer(job, size, warm + timed + extra, [timer], False, workdir)
        setup_s = time.perf_counter() - t0
        dropped = trainer.dropped_args
        emit(PARTIAL, {"params": params, "build_s": round(setup_s, 2), "op_load_s": op_load_s, "phase": "train"})
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    setup_s = (timer.first_step_at - t0) if timer.first_step_at else None
    split = splits[-1] if splits else None
    init_s = split.init_s if split else setup_s
    skipped = split.skipped[warm:warm + timed] if split and len(split.skipped) == len(timer.times) else None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rec = {"batch_size": size, "params": params, "build_s": round(setup_s, 2), "op_load_s": op_load_s,
           **summarise(timer.times[warm:warm + timed], skipped, size), **gpu_peaks(),
           "peak_host_gib": host_peak_gib(), "init_s": round(init_s, 2) if init_s is not None else None,
           "train_setup_s": round(setup_s, 2) if setup_s is not None else None, "wall_s": round(wall, 2),
           "hf_args_dropped": dropped, **loss_fields(losses)}
    if split:
        rec.update(split.fields(warm, warm + timed))
        rec["skipped_steps"] = sum(split.skipped)
        split.restore()
    yield rec


def measure_hf_auto_find(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """HF Trainer's auto_find_batch_size from a start above the fitting size: what it ends with, and when.
    Each attempt is reported as it begins, so a harness timeout still says how far it got."""
    (start,) = job["sizes"]
    sync = syncer(job["device"])
    load_cpu_adam()
    cap_memory(job)
    attempts: list[int] = []
    t0 = time.perf_counter()

    def on_begin(args) -> None:
        timer.times.clear()  # a new attempt: only the last (successful) one's steps count
        # the Trainer shrinks its own _train_batch_size; args keep the start size
        attempts.append(int(getattr(trainer, "_train_batch_size", None) or args.per_device_train_batch_size))
        emit(PARTIAL, {"attempts": attempts, "elapsed_s": round(time.perf_counter() - t0, 1)})

    timer = step_timer_callback(sync, on_begin)
    rec: dict[str, Any] = {"batch_size": start}
    with tempfile.TemporaryDirectory() as workdir:
        trainer, params = hf_trainer(job, start, job["warmup"] + job["steps"], [timer], True, workdir)
        rec["params"] = params
        t0 = time.perf_counter()
        try:
            trainer.train()
            found = getattr(trainer, "_train_batch_size", None) or trainer.args.per_device_train_batch_size
            rec.update(outcome=f"trained at batch {found}", found_batch_size=found,
                       **summarise(timer.times[job["warmup"]:], None, found))
        except Exception as exc:  # giving up (or an OOM it let through) is the result measured
            if "executable batch size" not in str(exc) and not failure_fields(exc)["oom"]:
                raise  # anything else is a harness or setup error, reported as such
            rec.update(outcome=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                       found_batch_size=None)
    rec.update(elapsed_s=round(time.perf_counter() - t0, 1), attempts=attempts, **gpu_peaks(),
               peak_host_gib=host_peak_gib())
    # step_s/samples_per_s describe the found size; the record's batch_size stays the start size
    yield rec
