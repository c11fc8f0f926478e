"""`fitone probe-batch` and `--batch-size auto`: the search of probe.py, run on a real DeepSpeed engine.

A trial runs exactly what training runs: the same ZeRO-2 (+ CPU offload) engine, precision and activation
checkpointing, and full steps (forward, backward with its gradient transfers, optimizer step) on the
worst-case batch. One model and one engine serve the whole search, because a t5-3b engine takes 40-80 s to
build. The model is built from its config with random weights straight on the device (memory does not
depend on the values, and a CPU init of billions of weights takes minutes).

Results are saved under ~/.cache/fitone/probes/ (or $FITONE_CACHE_DIR/probes/), keyed by everything that
decides memory, so `fitone train --batch-size auto` reuses a probe instead of repeating it. A capped probe
(no size ran out of memory before max_batch) did not find the card's limit: it is saved under its own key
and never reused by --batch-size auto.

On a CPU nothing runs out of memory the way a GPU does, so there is no limit to search for: a probe there
needs an explicit max_batch (the notebook's demonstration gives 8), which the plan's host RAM bounds too.
"""

from __future__ import annotations

import datetime as dt
import glob
import hashlib
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from fitone import memory
from fitone.config import TrainConfig
from fitone.data import Dataset, load_dataset, worst_case_batch
from fitone.ds_config import build_ds_config
from fitone.engine import Engine
from fitone.errors import ConfigError
from fitone import loss as fused_loss
from fitone.models import CAUSAL, build_model, check_seq_len, enable_activation_checkpointing, load_tokenizer
from fitone.packing import require_exact_packing
from fitone.plan import unforeseen_oom
from fitone.probe import ProbeResult, TrialResult, _check_arguments, search_batch_size
from fitone.run import Run, resolve
from fitone.runtime import Runtime
from fitone.zero2 import step_mode

Say = Callable[[str], None]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# fp16's loss scale starts at 2^16 and an overflow skips the optimizer step, which would leave the step's
# memory and time out of a trial; the scale holds no memory, so the probe starts it at 2^0.
PROBE_LOSS_SCALE_POWER = 0
NAMED_SOURCES = ("sample", "synthetic")  # not files: the probe uses every sequence at the maximum lengths
DEFAULT_MAX_BATCH = 4096  # on a GPU, where running out of memory ends the search well before it


# ================================================================================================
# the public functions
# ================================================================================================

def probe_batch(
    cfg: TrainConfig | None = None,
    *,
    max_batch: int | None = None,
    max_trials: int = 16,
    margin: float = 0.05,
    verify_steps: int = 3,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    use_cache: bool = True,
    say: Say = print,
    on_model: Callable[[torch.nn.Module], None] | None = None,
    **overrides: Any,
) -> ProbeResult:
    """The largest micro-batch that trains on this GPU, its margin-backed choice, and what each trial measured.

    Takes the same options as `train` (a TrainConfig and/or its fields). A saved result for the same
    memory-deciding settings and the same search settings is reused unless `use_cache=False`; a new
    result is always saved. `max_batch` defaults to 4096 on a GPU; on the CPU it must be given (see the
    module's docstring) and the plan's host RAM bounds it. `on_model` is called with the probe's model
    before the engine is built (tests use it to add hooks); its effect is saved like any result, so point
    FITONE_CACHE_DIR elsewhere. `wall_s` covers everything from the call: model build, engine init, the
    search and teardown.
    """
    began = time.perf_counter()
    cfg = TrainConfig.with_overrides(cfg, overrides)
    search = dict(max_batch=max_batch, max_trials=max_trials, margin=margin, verify_steps=verify_steps)
    _check_arguments(**{**search, "max_batch": DEFAULT_MAX_BATCH if max_batch is None else max_batch}, start=1,
                     trial_steps=1)
    run = resolve(cfg)
    runtime = run.runtime()
    try:
        check_seq_len(run.model_config, cfg.seq_len, cfg.model)
        if cfg.pack and run.task == CAUSAL:
            require_exact_packing(run.model_config)
        if cfg.preflight:  # the plan's refusals from the config alone (training has made them already)
            from fitone.plan import preflight

            preflight(run)
        result = probe_on(run, runtime, **search, use_cache=use_cache, say=say, on_model=on_model, began=began)
        if json_path is not None:
            say(f"wrote {result.save_json(json_path)}")
        if plot_path is not None:
            say(f"wrote {result.plot(plot_path)}")
        return result
    finally:
        runtime.close()  # the process group it started (training closes its own)


def probe_on(run: Run, runtime: Runtime, *, max_batch: int | None = None, max_trials: int = 16,
             margin: float = 0.05, verify_steps: int = 3, use_cache: bool = True, say: Say = print,
             on_model: Callable[[torch.nn.Module], None] | None = None, for_training: bool = False,
             began: float) -> ProbeResult:
    """The probe of `run` on `runtime` (started here, after the cheap refusals, unless training started it): a
    saved result for these settings, else a new search, saved. `began`: when the caller's probe started;
    `for_training`: the probe of `train --batch-size auto`, whose advice names train's flags."""
    max_batch = _search_ceiling(run, max_batch, say, for_training)
    runtime.start()
    if runtime.world_size > 1:
        raise ConfigError(f"probe-batch runs on one GPU, but this is rank {runtime.rank} of "
                          f"{runtime.world_size}: run `fitone probe-batch` without a launcher, then train "
                          "with --batch-size N")
    key = probe_key(run)
    search = {"max_batch": max_batch, "max_trials": max_trials, "margin": margin, "verify_steps": verify_steps}
    cached = (read_cached(key, search) or read_cached(capped_key(key), search)) if use_cache else None
    if cached is not None:
        capped = f", capped at max_batch={max_batch}" if cached.meta.get("capped") else ""
        say(f"reusing the probe saved {cached.meta.get('date', '')} in {cached.meta['cache_file']} (same model "
            f"config, precision, lengths, GPU and cap{capped}; --no-cache measures again)")
        return cached
    session = ProbeSession(run, say=say, on_model=on_model)
    try:
        result = search_batch_size(session.try_size, cap_bytes=session.cap_bytes, log=say, **search)
        result.meta.update(session.meta())
    finally:
        session.close()
    result.meta["gpu_allocated_after_close"] = torch.cuda.memory_allocated() if run.on_gpu else None
    result.meta["search_s"] = result.wall_s
    result.wall_s = time.perf_counter() - began
    # no size ran out of memory: the search stopped at its cap, not at the card's limit
    result.meta["capped"] = all(t.fits for t in result.trials)
    result.meta["cache_file"] = str(save_cached(capped_key(key) if result.meta["capped"] else key, search, result))
    use = (f"capped at max_batch={max_batch} without running out of memory, so --batch-size auto will not "
           "reuse it as the card's limit" if result.meta["capped"] else "for --batch-size auto")
    say(f"probe done in {result.wall_s:.1f} s (engine init {result.meta['engine_init_s']:.1f} s); "
        f"saved ({use}) in {result.meta['cache_file']}")
    return result


def batch_size_for_training(run: Run, runtime: Runtime, say: Say = print) -> int:
    """The micro-batch for `--batch-size auto`: a saved probe for these settings, else a new probe.

    Runs before the training model loads, on training's resolved run and started runtime; the probe's model
    and engine are freed before this returns. With --global-batch the micro-batch is the largest size <= the
    probe's choice that divides it.
    """
    cfg, world_size = run.settings, run.world_size
    # A ZeRO-2 rank holds the same 16-bit weights, buckets and activations as one GPU alone (measured:
    # 10.7 GiB peak at micro-batch 64 for t5-3b on one and on two H200s), so a one-GPU probe gives the
    # per-GPU micro-batch; ranks cannot probe together (an OOM on one rank hangs the others' collectives).
    # any search settings; never a capped one
    result = read_cached(probe_key(run), full_only=True)
    if result is not None:
        say(f"--batch-size auto: reusing the probe saved {result.meta.get('date', '')} in "
            f"{result.meta['cache_file']}")
    elif world_size > 1:
        raise ConfigError(f"--batch-size auto under {world_size} ranks needs a saved one-GPU probe: run "
                          "`fitone probe-batch` with the same model, lengths, precision, cap and "
                          "--[no-]pipelined-update flag without a launcher first (or pass --batch-size N)")
    else:
        say("--batch-size auto: no saved probe for this model, precision, lengths, GPU and cap: probing first")
        began = time.perf_counter()
        result = probe_on(run, runtime, use_cache=False, say=say, for_training=True, began=began)
    how = f"largest fit {result.largest_fit}, {result.margin * 100:g}% margin"
    if cfg.global_batch is not None:
        micro, accum = result.for_global_batch(cfg.global_batch, world_size)
        say(f"--batch-size auto: micro-batch {micro} x {accum} accumulation steps = --global-batch "
            f"{cfg.global_batch} (probe chose {result.chosen}; {how})")
        return micro
    say(f"--batch-size auto: micro-batch {result.chosen} ({how})")
    return result.chosen


def save_to_recipe(result: ProbeResult, recipe_path: str | Path) -> Path:
    """Write `batch_size: N` into a recipe YAML, in place, keeping its comments; say what was measured.

    The value of a top-level `batch_size:` line is replaced (its inline comment kept) or the line is
    added; a `# probe-batch: ...` line at the end of the header comment records the measurement. A file
    that does not exist yet becomes a recipe of the probed settings.
    """
    import yaml

    path = Path(recipe_path)
    note = f"# probe-batch: {_measured(result)}"
    if path.exists():
        lines = path.read_text().splitlines()
    else:
        lines = [f"{k}: {_yaml_scalar(v)}" for k, v in _recipe_values(result.meta).items()]
    lines = [line for line in lines if not line.startswith("# probe-batch:")]
    for i, line in enumerate(lines):
        m = re.match(r"batch_size\s*:\s*[^#]*?(\s+#.*)?$", line)
        if m:
            lines[i] = f"batch_size: {result.chosen}{m.group(1) or ''}"
            break
    else:
        lines.append(f"batch_size: {result.chosen}")
    header_end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    lines.insert(header_end, note)
    text = "\n".join(lines) + "\n"
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--save {path}: cannot update this YAML ({exc}); add `batch_size: "
                          f"{result.chosen}` by hand") from exc
    if not isinstance(values, dict) or values.get("batch_size") != result.chosen:
        raise ConfigError(f"--save {path}: not a flat recipe with one `batch_size:` line; add `batch_size: "
                          f"{result.chosen}` by hand")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ================================================================================================
# one engine, many trials
# ================================================================================================

def _search_ceiling(run: Run, max_batch: int | None, say: Say, for_training: bool) -> int:
    """The largest size the search may try. A GPU's search ends where memory runs out; on the CPU nothing
    does, so the caller must set the ceiling, and the plan's host RAM lowers it (beyond, the OOM killer).
    `for_training`: the probe of `train --batch-size auto`, whose advice names train's flags."""
    if run.on_gpu:
        return DEFAULT_MAX_BATCH if max_batch is None else max_batch
    if max_batch is None:
        fix = ("give --batch-size N instead of auto" if for_training else
               "cap the probe with --max-batch N (probe_batch(max_batch=N)) to time sizes up to N, or train without "
               "one: `fitone train --batch-size N`")
        raise ConfigError("on the CPU nothing runs out of memory the way a GPU does, so a search for the largest "
                          "micro-batch has no limit to find (it would only stop at 4096, after minutes of CPU "
                          f"steps): {fix}")
    if run.settings.preflight:
        from fitone.plan import host_micro_batch_bound

        bound = host_micro_batch_bound(run)
        if 0 < bound < max_batch:
            say(f"on the CPU: the search stops at micro-batch {bound}, the largest the plan fits in host RAM "
                f"(max_batch was {max_batch})")
            return bound
    return max_batch


class ProbeSession:
    """A probe's model and DeepSpeed engine; `try_size(size, steps)` runs full training steps at a size.

    An out-of-memory error becomes `TrialResult(fits=False, oom_phase=...)`; any other error propagates.
    """

    def __init__(self, run: Run, *, say: Say = print, on_model: Callable[[torch.nn.Module], None] | None = None):
        """`run`: the resolved run it probes (as on one GPU: Run.for_probe)."""
        self.run = run = run.for_probe()
        self.cfg, self.config, self.device, self.say, self.on_model = run.settings, run.model_config, run.device, \
            say, on_model
        cfg, config = self.cfg, self.config
        self.task = run.task
        self.precision = run.precision
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
        first = worst_case_batch(self.task, 1, cfg, config.vocab_size, self.pad_id, self.data)
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
            self.model = build_random_model(self.config, self.device, DTYPES[self.precision], cfg.seed)
        self.model.config.use_cache = False  # as in training (packed rows are only seen without a KV cache)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.loss_backend = fused_loss.prepare(self.model, device=self.device, precision=self.precision,
                                               enabled=cfg.fused_loss)
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
        self.engine.ds.train()
        self.init_s += self.engine.init_s
        self.say(f"engine ready in {self.engine.init_s:.1f} s")

    def _worst_case_source(self) -> tuple[Dataset | None, int]:
        """With a data file: its examples (the probe takes the longest). Else None: every sequence at the max."""
        cfg, config = self.cfg, self.config
        if cfg.data in NAMED_SOURCES or (cfg.pack and self.task == CAUSAL):  # packed: every row is full anyway
            return None, config.pad_token_id if config.pad_token_id is not None else 0
        tokenizer = load_tokenizer(cfg.model, config, from_scratch=cfg.from_scratch)
        return load_dataset(cfg, self.task, tokenizer, config.vocab_size), tokenizer.pad_token_id

    # -- a trial ----------------------------------------------------------------------------------
    def try_size(self, size: int, steps: int) -> TrialResult:
        """`steps` full steps at micro-batch `size`: peak GPU memory (reset before), median step time."""
        try:
            return self._proven(self._run(size, steps))
        except AssertionError as exc:
            if not (self._reset_unproven and "computed twice" in str(exc)):
                raise
        # reset_after_oom did not restore ZeRO-2's bookkeeping (another DeepSpeed version?): start over
        self.say("ZeRO-2 reports 'Gradient computed twice for this partition' after the engine reset: rebuilding "
                 f"the engine, trying {size} again")
        self._rebuild()
        return self._proven(self._run(size, steps))

    def _proven(self, result: TrialResult) -> TrialResult:
        if result.fits:
            self._reset_unproven = False
        return result

    def _run(self, size: int, steps: int) -> TrialResult:
        engine = self.engine
        batch = worst_case_batch(self.task, size, self.cfg, self.config.vocab_size, self.pad_id, self.data)
        memory.reset_gpu_peak()  # a fitting trial leaves nothing behind; a failed one was cleaned up after it
        skipped_before = engine.skipped_steps
        times: list[float] = []
        phase, failed = "forward", None
        loss = None
        try:
            batch = {k: v.to(engine.device) for k, v in batch.items()}  # the batch's memory counts too
            for _ in range(steps):
                self._sync()
                start = time.perf_counter()
                phase = "forward"
                loss = engine.forward(batch)
                phase = "backward"
                engine.backward(loss)
                loss = None
                phase = "step"
                engine.step()  # the first one allocates the optimizer states
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
            return TrialResult(size, fits=False, oom_phase=failed, steps=len(times))
        skipped = engine.skipped_steps - skipped_before
        if skipped:
            self.skipped_steps += skipped
            self.say(f"{size}: {skipped} of {steps} optimizer steps skipped (fp16 overflow): their time leaves "
                     "out the optimizer")
        peak = memory.gpu_peak_bytes() if self.device == "cuda" else None
        return TrialResult(size, fits=True, peak_gpu_bytes=peak, step_s=statistics.median(times), steps=steps)

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
        import deepspeed
        import transformers

        import fitone

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
            "versions": {"fitone": fitone.__version__, "deepspeed": deepspeed.__version__,
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


def build_random_model(config, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The architecture of `config` with seeded random weights, made on `device` in `dtype`.

    Built on the meta device, then each parameter (tied ones once) is allocated where DeepSpeed will
    keep it and filled there: N(0, initializer_range) for matrices, 1 for norm weights, 0 for biases.
    """
    model = build_model(config, meta=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    made: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    data = torch.empty(param.shape, dtype=dtype, device=device)
                    if data.dim() >= 2:
                        data.normal_(0.0, std, generator=generator)
                    else:
                        data.fill_(0.0 if name == "bias" else 1.0)
                    made[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    return model.to(device)  # buffers (init_empty_weights leaves them real, on the CPU)


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


# ================================================================================================
# the saved results
# ================================================================================================

def cache_dir() -> Path:
    """~/.cache/fitone/probes, or $FITONE_CACHE_DIR/probes."""
    root = os.environ.get("FITONE_CACHE_DIR") or Path.home() / ".cache" / "fitone"
    return Path(root) / "probes"


def probe_key(run: Run) -> dict[str, Any]:
    """Everything that decides how much memory a step takes (the weights' values do not), from the resolved
    run; the key holds the step a one-GPU probe of it runs.

    Not in it, because a trial's memory does not depend on them: the seed, lr and schedule, the run's length,
    and the accumulation (a probe runs every step as an optimizer step; DeepSpeed's GPU buffer for
    accumulating is allocated at init whatever the accumulation, stage_1_and_2.py line 659)."""
    import deepspeed
    import transformers

    import fitone

    cfg, config, device, precision = run.settings, run.model_config, run.device, run.precision
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    lengths = ({"seq_len": cfg.seq_len} if run.task == CAUSAL
               else {"src_len": cfg.src_len, "tgt_len": cfg.tgt_len})
    key: dict[str, Any] = {
        "model_config": _digest(json.dumps(values, sort_keys=True, default=str)),
        "precision": precision, "activation_checkpointing": cfg.activation_checkpointing,
        "offload": cfg.offload, **lengths, "data": _data_key(cfg),
        "fused_loss": fused_loss.fused_loss_backend(config, device=device, precision=precision)
        if cfg.fused_loss else None,
        "ds_config": _digest(Path(cfg.ds_config).read_bytes()) if cfg.ds_config else None,
        "device": device, "gpu": memory.gpu_name(), "max_gpu_memory_bytes": run.cap_bytes,
        # what the allocator runs with: a user's PYTORCH_CUDA_ALLOC_CONF overrides --[no-]expandable-segments
        "allocator": memory.allocator_settings(cfg.expandable_segments) if device == "cuda" else None,
        "world_size": 1, "fitone": fitone.__version__, "deepspeed": deepspeed.__version__,
        # the allocator and kernels (torch) and the models' code (transformers) decide activation memory too
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if run.mode.on_one_gpu().name == step_mode.PIPELINED:
        key["pipelined_update"] = True  # its landing chunks take GPU memory (the delayed update's extra is on the host)
    return key


def _data_key(cfg: TrainConfig) -> Any:
    """What the worst-case batch is made of: full rows, the maximum lengths, or a data source's longest
    examples as the model's tokenizer cuts them (so the source's files and the tokenizer's files count)."""
    if cfg.pack:  # full rows whatever the data (a seq2seq model refuses --pack before this)
        return "packed rows"
    if cfg.data in NAMED_SOURCES:
        return "maximum lengths"
    return {"source": _files_key(cfg.data), "split": cfg.data_split, "config": cfg.data_config,
            "fields": [cfg.source_field, cfg.target_field, cfg.text_field, cfg.prompt_field],
            "tokenizer": {"model": cfg.model, "from_scratch": cfg.from_scratch, "files": _files_key(cfg.model)},
            **({"chat_template": _digest(Path(cfg.chat_template).read_bytes())} if cfg.chat_template else {})}


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")  # values, not sizes


def _files_key(spec: str) -> Any:
    """A local file, directory or glob as its files' names, sizes and mtimes (an edit re-measures); else the
    name (a hub id)."""
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(str(path), recursive=True))]
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.endswith(_WEIGHT_FILES))
    elif path.is_file():
        files = [path]
    else:
        return spec
    stats = [(f, f.stat()) for f in files if f.is_file()]
    return {"path": str(path.resolve()), "files": [[str(f.resolve()), st.st_size, st.st_mtime_ns] for f, st in stats]}


def _digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def cache_path(key: dict[str, Any]) -> Path:
    return cache_dir() / f"{_digest(json.dumps(key, sort_keys=True))}.json"


def capped_key(key: dict[str, Any]) -> dict[str, Any]:
    """Where a capped probe is saved: beside, never over, a full probe of the same settings."""
    return {**key, "capped": True}


def read_cached(key: dict[str, Any], search: dict[str, Any] | None = None, *,
                full_only: bool = False) -> ProbeResult | None:
    """The saved result for `key` (and these search settings, when given); None if there is none.
    `full_only`: None for a capped probe too (one saved before capped probes had their own key)."""
    path = cache_path(key)
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != key or (search is not None and entry["search"] != search):
            return None
        result = ProbeResult.from_dict(entry["result"])
        if full_only and result.meta.get("capped", all(t.fits for t in result.trials)
                                          and result.largest_fit >= entry["search"].get("max_batch", 0)):
            return None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or from another layout: measure again, and overwrite it
    result.meta["cache_file"] = str(path)
    return result


def save_cached(key: dict[str, Any], search: dict[str, Any], result: ProbeResult) -> Path:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"key": key, "search": search, "result": result.to_dict()}, indent=2) + "\n")
    tmp.replace(path)
    return path


# ================================================================================================
# helpers
# ================================================================================================

def _measured(result: ProbeResult) -> str:
    m = result.meta
    lengths = f"seq {m['seq_len']}" if "seq_len" in m else f"src/tgt {m.get('src_len')}/{m.get('tgt_len')}"
    cap = f", cap {m['max_gpu_memory']}" if m.get("max_gpu_memory") else ""
    check = "verified" if result.verified else "not verified"
    return (f"batch_size {result.chosen} = largest fit {result.largest_fit} less a {result.margin * 100:g}% "
            f"margin ({check}); {m.get('model')} {m.get('precision')}, {lengths}, "
            f"{'activation checkpointing' if m.get('activation_checkpointing') else 'no checkpointing'}, "
            f"on {m.get('gpu')}{cap} ({m.get('date', '')[:10]})")


def _recipe_values(meta: dict[str, Any]) -> dict[str, Any]:
    names = ("model", "from_scratch", "data", "pack", "src_len", "tgt_len", "seq_len", "precision",
             "activation_checkpointing", "offload", "max_gpu_memory", "device")
    values = {k: meta[k] for k in names if meta.get(k) is not None}
    # the optimizer step, only where the default would take another one (a saved probe serves both a
    # default run and an explicit --pipelined-update on a GPU: the recipe must not pin what was not asked)
    on_gpu = meta.get("device") == "cuda"
    if meta.get("update") == "pipelined" and not on_gpu:
        values["pipelined_update"] = True
    elif meta.get("update") == "deepspeed" and on_gpu and meta.get("offload") == "cpu":
        values["pipelined_update"] = False
    return values


def _yaml_scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()

