"""`fitone probe-batch` and `--batch-size auto`: the search of search.py, run on a real DeepSpeed engine.

On a CPU nothing runs out of memory the way a GPU does, so there is no limit to search for: a probe there
needs an explicit max_batch (the notebook's demonstration gives 8), which the plan's host RAM bounds too.
The run's decisions (device, precision, step mode, cap) come resolved (fitone.run), from training or here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from fitone.config import TrainConfig
from fitone.errors import ConfigError
from fitone.models import CAUSAL, check_seq_len
from fitone.packing import require_exact_packing
from fitone.plan import host_micro_batch_bound, preflight
from fitone.probe.cache import capped_key, probe_key, read_cached, save_cached
from fitone.probe.choice import UncheckedChoice, choose_batch
from fitone.probe.results import ProbeResult, TrialResult
from fitone.probe.search import (DEFAULT_MAX_BATCH, DEFAULT_MARGIN, DEFAULT_MAX_TRIALS, DEFAULT_VERIFY_STEPS,
                                  check_arguments, search_batch_size)
from fitone.probe.trial import ProbeSession, Say
from fitone.render import choice_reason, plot_probe
from fitone.run import Run, resolve
from fitone.runtime import Runtime



def probe_batch(
    cfg: TrainConfig | None = None,
    *,
    max_batch: int | None = None,
    max_trials: int = DEFAULT_MAX_TRIALS,
    margin: float = DEFAULT_MARGIN,
    verify_steps: int = DEFAULT_VERIFY_STEPS,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    use_cache: bool = True,
    say: Say = print,
    on_model: Callable[[torch.nn.Module], None] | None = None,
    **overrides: Any,
) -> ProbeResult:
    """The largest micro-batch that trains on this GPU, its margin-backed size, the micro-batch and accumulation
    to train with (`prefer_batch`: the most samples/s for `global_batch`, or the largest; fitone.probe.choice),
    and what each trial measured.

    Takes the same options as `train` (a TrainConfig and/or its fields). A saved result for the same
    memory-deciding settings and the same search settings and choice is reused unless `use_cache=False`; a new
    result is always saved. `max_batch` defaults to DEFAULT_MAX_BATCH on a GPU; on the CPU it must be given (see the
    module's docstring) and the plan's host RAM bounds it. `on_model` is called with the probe's model
    before the engine is built (tests use it to add hooks); its effect is saved like any result, so point
    FITONE_CACHE_DIR elsewhere. `wall_s` covers everything from the call: model build, engine init, the
    search and teardown.
    """
    began = time.perf_counter()
    cfg = TrainConfig.with_overrides(cfg, overrides)
    search = dict(max_batch=max_batch, max_trials=max_trials, margin=margin, verify_steps=verify_steps)
    check_arguments(**{**search, "max_batch": DEFAULT_MAX_BATCH if max_batch is None else max_batch}, start=1,
                     trial_steps=1)
    cfg.check_paths()  # once per run (training's own probe goes through probe_on: training checked them)
    run = resolve(cfg)
    runtime = run.runtime()
    try:
        check_seq_len(run.model_config, cfg.seq_len, cfg.model)
        if cfg.pack and run.task == CAUSAL:
            require_exact_packing(run.model_config)
        if cfg.preflight:  # the plan's refusals from the config alone (training has made them already)
            preflight(run)
        result = probe_on(run, runtime, **search, use_cache=use_cache, say=say, on_model=on_model, began=began)
        if json_path is not None:
            say(f"wrote {result.save_json(json_path)}")
        if plot_path is not None:
            say(f"wrote {plot_probe(result, plot_path)}")
        return result
    finally:
        runtime.close()  # the process group it started (training closes its own)


def probe_on(run: Run, runtime: Runtime, *, max_batch: int | None = None, max_trials: int = DEFAULT_MAX_TRIALS,
             margin: float = DEFAULT_MARGIN, verify_steps: int = DEFAULT_VERIFY_STEPS, use_cache: bool = True,
             say: Say = print,
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
    searched = {"max_batch": max_batch, "max_trials": max_trials, "margin": margin, "verify_steps": verify_steps}
    search = {**searched, **choice_key(run)}  # what a saved result must match: the search and how it chose
    cached = (read_cached(key, search) or read_cached(capped_key(key), search)) if use_cache else None
    if cached is not None and run.settings.prefer_batch == "largest":
        cached = _rechosen(cached, run, say)
    if cached is not None:
        capped = f", capped at max_batch={max_batch}" if cached.meta.get("capped") else ""
        say(f"reusing the probe saved {cached.meta.get('date', '')} in {cached.meta['cache_file']} (same model "
            f"config, precision, lengths, GPU and cap{capped}, same choice; --no-cache measures again)")
        return cached
    session = ProbeSession(run, say=say, on_model=on_model)
    try:
        result = search_batch_size(session.try_size, cap_bytes=session.cap_bytes, log=say, **searched)
        _choose(result, run, session.try_size, steps=verify_steps or 1, say=say)
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


def choice_key(run: Run) -> dict[str, Any]:
    """What decides the choice beyond the memory search: the preference and, for a throughput choice (timed),
    the samples per optimizer step on one GPU (--global-batch over the ranks) or the fixed accumulation."""
    cfg = run.settings
    cfg.accumulation(1, run.world_size)  # a --global-batch the ranks do not split: refused before any trial
    if cfg.prefer_batch == "largest":  # no timing: made again from the saved search for any global batch
        return {"prefer": "largest"}
    # "checked": a result whose chosen pair ran accumulated steps (one saved before that fix is not reused)
    if cfg.global_batch is not None:
        return {"prefer": "throughput", "global_batch": cfg.global_batch // run.world_size, "checked": True}
    return {"prefer": "throughput", "accumulation": cfg.accumulation(1), "checked": True}


def _choose(result: ProbeResult, run: Run, time_step: Callable[[int, int, int], TrialResult] | None, *,
            steps: int, say: Say) -> ProbeResult:
    cfg = run.settings
    return choose_batch(result, prefer=cfg.prefer_batch, time_step=time_step, steps=steps, log=say,
                        accumulation=lambda b: cfg.accumulation(b, run.world_size),
                        global_batch=None if cfg.global_batch is None else cfg.global_batch // run.world_size)


def _rechosen(result: ProbeResult, run: Run, say: Say) -> ProbeResult | None:
    """A saved search's largest choice made again for this run's accumulation; None when no saved trial shows
    that pair runs accumulated steps (the probe must run again: only an engine can check it)."""
    try:
        return _choose(result, run, None, steps=0, say=say)
    except UncheckedChoice as exc:
        say(f"the saved probe cannot be reused: {exc} (accumulating takes more memory than one micro-batch a step)")
        return None


def batch_size_for_training(run: Run, runtime: Runtime, say: Say = print) -> int:
    """The micro-batch for `--batch-size auto`: a saved probe for these settings, else a new probe.

    Runs before the training model loads, on training's resolved run and started runtime; the probe's model
    and engine are freed before this returns. The micro-batch is the probe's choice (--prefer-batch) for
    this run's --global-batch, whose accumulation Run.with_batch derives as the probe did.
    """
    cfg, world_size = run.settings, run.world_size
    # A ZeRO-2 rank holds the same 16-bit weights, buckets and activations as one GPU alone (measured:
    # 10.7 GiB peak at micro-batch 64 for t5-3b on one and on two H200s), so a one-GPU probe gives the
    # per-GPU micro-batch; ranks cannot probe together (an OOM on one rank hangs the others' collectives).
    # any search settings, the same choice; never a capped one
    result = read_cached(probe_key(run), full_only=True, choice=choice_key(run))
    if result is not None and cfg.prefer_batch == "largest":  # untimed: made from any saved search, for this run
        result = _rechosen(result, run, say)
    if result is not None:
        say(f"--batch-size auto: reusing the probe saved {result.meta.get('date', '')} in "
            f"{result.meta['cache_file']}")
    elif world_size > 1:
        share = choice_key(run).get("global_batch")  # a throughput choice is timed for each GPU's share
        per_gpu = f", --global-batch {share} (this run's per GPU)" if share is not None else ""
        raise ConfigError(f"--batch-size auto under {world_size} ranks needs a saved one-GPU probe: run "
                          f"`fitone probe-batch` with the same model, lengths, precision, cap{per_gpu} and "
                          "--[no-]pipelined-update flag without a launcher first (or pass --batch-size N)")
    else:
        say("--batch-size auto: no saved probe for this model, precision, lengths, GPU and cap: probing first")
        began = time.perf_counter()
        result = probe_on(run, runtime, use_cache=False, say=say, for_training=True, began=began)
    how = (f"{choice_reason(result)}: largest fit {result.largest_fit} less a {result.margin * 100:g}% margin "
           f"is {result.chosen}")
    micro, accum = result.micro_batch, result.accumulation
    if cfg.global_batch is not None:
        say(f"--batch-size auto: micro-batch {micro} x {accum} accumulation steps = --global-batch "
            f"{cfg.global_batch} ({how})")
        return micro
    say(f"--batch-size auto: micro-batch {micro}" + (f" x {accum} accumulation steps" if accum > 1 else "")
        + f" ({how})")
    return micro


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
                          f"micro-batch has no limit to find (it would only stop at {DEFAULT_MAX_BATCH}, after minutes "
                          f"of CPU steps): {fix}")
    if run.settings.preflight:
        bound = host_micro_batch_bound(run)
        if 0 < bound < max_batch:
            say(f"on the CPU: the search stops at micro-batch {bound}, the largest the plan fits in host RAM "
                f"(max_batch was {max_batch})")
            return bound
    return max_batch
