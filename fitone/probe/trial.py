"""One probe trial session: the model and DeepSpeed engine that every size of a search runs on.

A trial runs exactly what training runs: the same ZeRO-2 (+ CPU offload) engine, precision and activation
checkpointing, and full steps (forward, backward with its gradient transfers, optimizer step) on the
worst-case batch. One model and one engine serve the whole search, because a t5-3b engine takes 40-80 s to
build. The model is built from its config with random weights straight on the device (memory does not
depend on the values, and a CPU init of billions of weights takes minutes).
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from typing import Any, Callable

import torch

import fitone
from fitone import memory
from fitone.data import Dataset, load_dataset, worst_case_batch
from fitone.ds_config import build_ds_config
from fitone.engine import Engine
from fitone.build import prepare_for_training
from fitone.models import CAUSAL, load_tokenizer
from fitone.plan import unforeseen_oom
from fitone.probe.results import TrialResult
from fitone.random_init import build_random_model
from fitone.run import WEIGHT_DTYPES, Run
from fitone.zero2 import installed_version
from fitone.zero2.errors import is_gradient_computed_twice

Say = Callable[[str], None]
# fp16's loss scale starts at 2^16 and an overflow skips the optimizer step, which would leave the step's
# memory and time out of a trial; the scale holds no memory, so the probe starts it at 2^0.
PROBE_LOSS_SCALE_POWER = 0
NAMED_SOURCES = ("sample", "synthetic")  # not files: the probe uses every sequence at the maximum lengths



class ProbeSession:
    """A probe's model and DeepSpeed engine; `try_size(size, steps)` runs full training steps at a size.

    An out-of-memory error becomes `TrialResult(fits=False, oom_phase=...)`; any other error propagates.
    """

    def __init__(self, run: Run, *, say: Say = print, on_model: Callable[[torch.nn.Module], None] | None = None):
        """`run`: the resolved run it probes, as on one GPU (Run.for_probe)."""
        self.run = run = run.for_probe()
        self.cfg, self.config, self.device = run.settings, run.model_config, run.device
        self.say, self.on_model = say, on_model
        cfg, config = self.cfg, self.config
        self.task, self.precision = run.task, run.precision
        self.cap_bytes = run.cap_bytes or memory.gpu_total_bytes()
        self.data, self.pad_id = self._worst_case_source()
        self.ds_config = probe_ds_config(run)
        self.mode = run.mode  # training's, on one GPU
        self.update = self.mode.name
        self.rebuilds = 0
        self.skipped_steps = 0
        self.init_s = 0.0  # engine init, over every engine this session built
        self._reset_unproven = False  # an engine reset after an OOM that no trial has passed since
        self.engine: Engine | None = None
        self.model: torch.nn.Module | None = None
        try:
            self._build()
        except BaseException:
            self.close()  # a half-built engine holds GPU and pinned host memory too
            raise
        first = worst_case_batch(self.task, 1, cfg.data_settings(), config.vocab_size, self.pad_id, self.data)
        self.batch_tokens = {k: int(first[k].shape[1]) for k in ("input_ids", "labels")}
        lengths = (f"{self.batch_tokens['input_ids']} tokens" if self.task == CAUSAL
                   else f"{self.batch_tokens['input_ids']} input + {self.batch_tokens['labels']} target tokens")
        where = f"the longest examples of {cfg.data}" if self.data is not None else \
            "full packed rows" if cfg.pack and self.task == CAUSAL else "every sequence at the maximum"
        say(f"worst-case batch: {where} ({lengths} each)")
        if not run.on_gpu:
            say("on the CPU: peak GPU memory is not measurable (recorded as None) and nothing runs out of "
                "memory the way a GPU does; use a GPU for a real answer")

    # -- setup ------------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.cfg
        start = time.perf_counter()
        with unforeseen_oom("model build", verbose=cfg.verbose):
            self.model = build_random_model(self.config, self.device, WEIGHT_DTYPES[self.precision], cfg.seed)
        self.loss_backend = prepare_for_training(self.run, self.model)  # as training runs it
        if self.on_model is not None:
            self.on_model(self.model)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.build_s = time.perf_counter() - start
        if self.engine is None:
            ckpt = "activation checkpointing" if cfg.activation_checkpointing else "no activation checkpointing"
            self.say(f"built {cfg.model} from its config with random weights ({self.n_params / 1e6:,.1f}M params, "
                     f"{self.precision}, {ckpt}) in {self.build_s:.1f} s; starting the DeepSpeed ZeRO-2 engine "
                     f"(optimizer on {'the CPU' if cfg.offload == 'cpu' else 'the GPU'})")
        torch.manual_seed(cfg.seed)  # dropout masks, as in training
        with unforeseen_oom("engine init", verbose=cfg.verbose):
            self.engine = Engine(self.model, self.ds_config, **self.mode.engine_options())
        self.engine.train_mode()
        self.init_s += self.engine.init_s
        self.say(f"engine ready in {self.engine.init_s:.1f} s")

    def _worst_case_source(self) -> tuple[Dataset | None, int]:
        """With a data file: its examples (the probe takes the longest). Else None: every sequence at the max."""
        cfg, config = self.cfg, self.config
        if cfg.data in NAMED_SOURCES or (cfg.pack and self.task == CAUSAL):  # packed: every row is full anyway
            return None, config.pad_token_id if config.pad_token_id is not None else 0
        tokenizer = load_tokenizer(cfg.model, config, from_scratch=cfg.from_scratch)
        return load_dataset(cfg.data_settings(), self.task, tokenizer, config.vocab_size), tokenizer.pad_token_id

    # -- a trial ----------------------------------------------------------------------------------
    def try_size(self, size: int, steps: int, accumulation: int = 1) -> TrialResult:
        """`steps` full steps at micro-batch `size`, each `accumulation` forwards and backwards and one
        optimizer update: peak GPU memory (reset before), median step time."""
        try:
            return self._proven(self._run(size, steps, accumulation))
        except AssertionError as exc:
            if not (self._reset_unproven and is_gradient_computed_twice(exc)):
                raise
        # reset_after_oom did not restore ZeRO-2's bookkeeping (another DeepSpeed version?): start over
        self.say("ZeRO-2 reports 'Gradient computed twice for this partition' after the engine reset: rebuilding "
                 f"the engine, trying {size} again")
        self._rebuild()
        return self._proven(self._run(size, steps, accumulation))

    def _proven(self, result: TrialResult) -> TrialResult:
        if result.fits:
            self._reset_unproven = False
        return result

    def _run(self, size: int, steps: int, accumulation: int) -> TrialResult:
        engine = self.engine
        batch = worst_case_batch(self.task, size, self.cfg.data_settings(), self.config.vocab_size, self.pad_id,
                                 self.data)
        memory.reset_gpu_peak()  # a fitting trial leaves nothing behind; a failed one was cleaned up after it
        skipped_before = engine.skipped_steps
        times: list[float] = []
        phase, failed = "forward", None
        loss = None
        try:
            batch = {k: v.to(engine.device) for k, v in batch.items()}  # the batch's memory counts too
            with engine.accumulating(accumulation) as before_micro_step:
                for _ in range(steps):
                    self._sync()
                    start = time.perf_counter()
                    for i in range(accumulation):
                        before_micro_step(i)
                        phase = "forward"
                        loss = engine.forward(batch)
                        phase = "backward"
                        engine.backward(loss)
                        loss = None
                        phase = "step"
                        engine.step()  # the first update allocates the optimizer states
                    self._sync()
                    times.append(time.perf_counter() - start)
        except Exception as exc:
            if not memory.is_oom_error(exc):
                raise
            failed = phase
        # out of the except block: the traceback, and the activations its frames held, are gone
        loss = batch = None
        if failed is not None:
            if failed != "forward":  # ZeRO-2's gradient bookkeeping is half-done: reset it
                self._reset()
            memory.free_memory()
            return TrialResult(size, fits=False, oom_phase=failed, steps=len(times), accumulation=accumulation)
        skipped = engine.skipped_steps - skipped_before
        if skipped:
            self.skipped_steps += skipped
            self.say(f"{size}: {skipped} of {steps} optimizer steps skipped (fp16 overflow): their time leaves "
                     "out the optimizer")
        peak = memory.gpu_peak_bytes() if self.device == "cuda" else None
        return TrialResult(size, fits=True, peak_gpu_bytes=peak, step_s=statistics.median(times), steps=steps,
                           accumulation=accumulation)

    def _reset(self) -> None:
        try:
            self.engine.reset_after_oom()
            self._reset_unproven = True
        except Exception as exc:  # any failure here means: start over with a fresh engine
            self.say(f"resetting the engine after an OOM failed ({type(exc).__name__}: {exc}); rebuilding it")
            self._rebuild()

    def _rebuild(self) -> None:
        self._close_engine()
        self.rebuilds += 1
        self._build()
        self._reset_unproven = False

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    # -- reporting and teardown -------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        import transformers

        cfg = self.cfg
        lengths = ({"seq_len": cfg.seq_len} if self.task == CAUSAL
                   else {"src_len": cfg.src_len, "tgt_len": cfg.tgt_len})
        return {
            "model": cfg.model, "from_scratch": cfg.from_scratch, "task": self.task, "params": self.n_params,
            **lengths, "batch_input_tokens": self.batch_tokens["input_ids"],
            "batch_target_tokens": None if self.task == CAUSAL else self.batch_tokens["labels"],
            "data": cfg.data, "pack": cfg.pack,
            "worst_case": "longest examples" if self.data is not None else
            "packed rows" if cfg.pack and self.task == CAUSAL else "maximum lengths",
            "precision": self.precision, "activation_checkpointing": cfg.activation_checkpointing,
            "fused_loss": self.loss_backend, "offload": cfg.offload, "update": self.update,
            "pipelined_update": cfg.pipelined_update,
            "ds_config": cfg.ds_config,
            "device": self.device, "gpu": memory.gpu_name(),
            "max_gpu_memory": cfg.max_gpu_memory, "gpu_total_bytes": memory.gpu_total_bytes(), "world_size": 1,
            "engine_init_s": self.init_s, "model_build_s": self.build_s,
            "engine_rebuilds": self.rebuilds, "skipped_steps": self.skipped_steps,
            "peak_measured": self.device == "cuda",
            "versions": {"fitone": fitone.__version__, "deepspeed": installed_version(),
                         "torch": torch.__version__, "transformers": transformers.__version__},
            "date": dt.datetime.now().isoformat(timespec="seconds"),
        }

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self.model = None

    def close(self) -> None:
        """Free the model, the engine and their GPU and host memory (training may load its model next)."""
        self._close_engine()
        memory.free_memory()


def probe_ds_config(run: Run) -> dict[str, Any]:
    """Training's DeepSpeed config, with accumulation 1 so every step is an optimizer step.

    DeepSpeed fixes the micro-batch at init but takes any batch shape in forward, so one engine built
    for micro-batch 1 serves every size.
    """
    ds = build_ds_config(run.for_probe())
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1)
    if "fp16" in ds:
        ds["fp16"] = {**ds["fp16"], "initial_scale_power": PROBE_LOSS_SCALE_POWER}
    return ds
