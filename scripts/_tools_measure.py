"""The tool comparison's loops without a Trainer: fitone.train, the hand-written DeepSpeed loop, plain PyTorch.

Each measure_* runs in a child of scripts/bench_tools.py and yields one record per batch size.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from _harness import GIB
from _tools_child import (PARTIAL, build_on_cpu, cap_memory, emit, end_init, failure_fields, gpu_peaks, host_peak_gib,
                          load_cpu_adam, loss_fields, make_batch, median_parts, model_config, param_count,
                          reset_gpu_peak, run_steps, summarise, syncer, train_config)
from _tools_split import EngineSplit, split_fields

# fitone with these options (`fitone` alone: its defaults, the pipelined update on one GPU)
FITONE_VARIANTS = {"fitone-delayed": {"delayed_update": True, "delayed_update_after": 1},
                   "fitone-pipelined": {"pipelined_update": True},
                   "fitone-deepspeed-step": {"pipelined_update": False},
                   "fitone-speculative": {"pipelined_update": True, "speculative_update": True},
                   "fitone-share": {"pipelined_update": True, "gpu_adam_share": 0.4},
                   "fitone-speculative-share": {"pipelined_update": True, "speculative_update": True,
                                                "gpu_adam_share": 0.4}}
SKIP_MARGIN = 3  # fp16: steps run beyond warm-up + timed, for the warm-up to go on over overflowed steps
# fitone's defaults with Adam's 16-bit gradients widened in slices of this many elements (fitone.zero2.layout)
WIDEN_VARIANTS = {"fitone-widen-2m": 2**21, "fitone-widen-8m": 2**23}


def measure_fitone(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """fitone.train at one micro-batch; its own CUDA-synchronised step times, its Engine's timing hook for
    the split (fitone.zero2.timing.timed_engines).

    `fitone` runs fitone's defaults (on one GPU: the pipelined update); fitone-deepspeed-step /
    fitone-pipelined / fitone-delayed force DeepSpeed's step, the pipelined update, or the delayed update
    from the second step; fitone-speculative the pipelined update with --speculative-update; fitone-share /
    fitone-speculative-share those with --gpu-adam-share 0.4 (the best on llama-7b, 2026-12-07d); fitone-widen-2m /
    -8m widen Adam's 16-bit gradients in slices of that many elements instead of a whole chunk; fitone-host-cast
    sends up the 16-bit cast Adam writes on the host (fitone.zero2.upload.HOST_CAST; 2026-12-08's call 1 ran it as
    `fitone`, with the default then on, against `fitone-gpu-cast`, today's default). The split
    detail only for DeepSpeed's step: an overlapped update's CPU work runs beside the next step's GPU work; its
    split has the update's own counters instead (update_cpu_adam_s, update_thread_s, update_wait_s; with
    --speculative-update also update_speculated_chunks, update_rolled_back_chunks, update_redone_chunks,
    update_speculative_adam_s).
    With --grad-accum K, global_batch = micro x K: a step is K
    micro-batches. peak_gpu_init_gib is the harness's reading over fitone's whole Engine construction;
    engine_init_peak_gpu_gib fitone's own count where its Engine exposes one (init_peak_gpu_bytes).
    """
    import fitone
    from fitone.run import resolve_planned
    from fitone.zero2.timing import timed_engines

    (size,) = job["sizes"]
    config = model_config(job)
    params = param_count(config)
    emit(PARTIAL, {"params": params})
    op_load_s = load_cpu_adam()
    warm, timed, extra = job["warmup"], job["steps"], job["split_steps"]
    options = dict(FITONE_VARIANTS.get(job["tool"], {}))
    if job["tool"] in WIDEN_VARIANTS:
        from fitone.zero2 import layout

        layout.WIDEN_ELEMENTS = WIDEN_VARIANTS[job["tool"]]  # read when the engine builds its LeanHost
    if job["tool"] == "fitone-host-cast":
        from fitone.zero2 import upload

        upload.HOST_CAST = True  # read when the pipelined update builds its Uploads
    accum = job.get("grad_accum", 1)
    if accum > 1:
        options["global_batch"] = size * accum
    mode = resolve_planned(train_config(job, size, **options), 1).mode.name  # the step training will take
    extra = extra if mode == "deepspeed" else 0
    built: list[tuple[float, int | None]] = []  # per Engine: the GPU peak of building it, its own count

    def on_built(engine: Any) -> None:
        built.append((end_init(), getattr(engine, "init_peak_gpu_bytes", None)))
        emit(PARTIAL, {"phase": "steps"})

    # fp16's first steps overflow: the DeepSpeed loop keeps warming while the last step was skipped (run_steps),
    # and so does this, from a few steps more (the window is chosen once the skips are known)
    margin = SKIP_MARGIN if job["precision"] == "fp16" and warm else 0
    profile = (warm + margin + timed + extra, job["profile"]) if job.get("profile") else None  # one more step
    cfg = train_config(job, size, max_steps=warm + margin + timed + extra + (profile is not None), **options)
    detail_from = warm + margin + timed  # the split's detail steps (DeepSpeed's step only), after any margin
    with timed_engines(detail_from=detail_from if extra else None, on_built=on_built, profile=profile,
                       on_start=lambda: emit(PARTIAL, {"phase": "engine init"})) as timers:
        emit(PARTIAL, {"phase": "fitone setup (model build)"})
        t0 = time.perf_counter()
        result = fitone.train(cfg)
        wall = time.perf_counter() - t0
    timer = timers[-1] if timers else None
    every = list(result.step_times)
    skipped_all = ([not ok for ok in timer.applied] if timer is not None and len(timer.applied) == len(every)
                   else [False] * len(every))
    first = timed_window(skipped_all, warm, margin)
    times, skipped = every[first:first + timed], skipped_all[first:first + timed]
    rec = {"batch_size": size, "params": params, "op_load_s": op_load_s,
           **summarise(times, skipped, size * result.grad_accum),
           **gpu_peaks(),
           "peak_host_gib": round(max(result.peak_host_rss_bytes / GIB, host_peak_gib()), 3),
           "init_s": round(result.init_s, 2), "wall_s": round(wall, 2), "skipped_steps": result.skipped_steps,
           "grad_accum": result.grad_accum, "fitone_samples_per_s": round(result.samples_per_s, 2),
           "update": result.update, "delayed_update": result.update == "delayed",
           "pipelined_update": result.update == "pipelined",
           **loss_fields(list(result.losses))}
    rec["warmup_used"] = first
    if timer is not None:
        rec.update(split_fields(timer, first, first + timed, detail=(detail_from, detail_from + extra)))
        # each timed step's phases and the update's counters (those of the update that completed in it: the
        # last step's), to tell which steps are slow and why
        rec["per_step"] = [{"step_s": round(t, 4), "applied": ok, **{k: round(v, 4) for k, v in s.items()}}
                           for t, ok, s in zip(times, timer.applied[first:], timer.steps[first:])]
    if built:
        rec["peak_gpu_init_gib"], own = built[-1]
        rec["engine_init_peak_gpu_gib"] = round(own / GIB, 3) if own is not None else None
    yield rec


def timed_window(skipped: list[bool], warm: int, margin: int) -> int:
    """The first timed step of a run whose length was fixed in advance: after `warm` steps, and up to `margin`
    more while the step before it was skipped (run_steps' rule for the loops that decide as they go)."""
    first = warm
    while first < warm + margin and skipped[first - 1]:
        first += 1
    return first


def measure_deepspeed(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A hand-written deepspeed.initialize loop with fitone's ZeRO-2 offload config (the blog's), as users
    write it. With several sizes (--same-process) one engine serves them all: ZeRO-2's buffers depend on
    the bucket sizes, not the micro-batch, so only the config's batch fields (unused here) differ.
    --ds-param-groups N hands deepspeed.initialize N parameter groups (split_param_groups) instead of one
    list; --grad-accum K sets gradient_accumulation_steps K and a step is K micro-batches."""
    import deepspeed

    from fitone.ds_config import build_ds_config
    from fitone.run import resolve_planned

    sizes, sync = job["sizes"], syncer(job["device"])
    accum = job.get("grad_accum", 1)
    op_load_s = load_cpu_adam()
    model, config, params, build_s = build_on_cpu(job)
    cap_memory(job)
    cfg = train_config(job, sizes[0], **({"global_batch": sizes[0] * accum} if accum > 1 else {}))
    ds = build_ds_config(resolve_planned(cfg, 1).with_batch(sizes[0]))  # the job's device (train_config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = split_param_groups(trainable, job.get("ds_param_groups", 1))
    # one group: the flat list, exactly as before the option existed
    model_parameters = trainable if len(groups) == 1 else [{"params": g} for g in groups]
    emit(PARTIAL, {"params": params, "build_s": round(build_s, 2), "op_load_s": op_load_s, "phase": "engine init",
                   "ds_param_groups": len(groups)})
    reset_gpu_peak()
    t0 = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model_parameters, config=ds)
    init_s = time.perf_counter() - t0
    init_peak = end_init()
    host_after_init = host_peak_gib()
    emit(PARTIAL, {"init_s": round(init_s, 2), "host_after_init_gib": host_after_init, "phase": "steps"})
    for size in sizes:
        base = {"batch_size": size, "params": params, "build_s": round(build_s, 2), "op_load_s": op_load_s,
                "init_s": round(init_s, 2), "host_after_init_gib": host_after_init, "peak_gpu_init_gib": init_peak,
                "grad_accum": accum, "ds_param_groups": len(groups),
                "ds_param_group_sizes": [sum(p.numel() for p in g) for g in groups],
                **({"init_shared": True} if size != sizes[0] else {})}
        try:
            batch = make_batch(job, config, size, engine.device)
            reset_gpu_peak()
            rec = run_ds_steps(engine, batch, size, job, sync)
        except Exception as exc:
            if not failure_fields(exc)["oom"]:
                raise
            yield {**base, **failure_fields(exc), **gpu_peaks(), "peak_host_gib": host_peak_gib()}
            return
        yield {**base, **rec, **gpu_peaks(), "peak_host_gib": host_peak_gib()}


def split_param_groups(params: list, n: int) -> list[list]:
    """`params` cut into min(n, len(params)) consecutive, non-empty groups of about equal numel: each group
    takes parameters while that brings it closer to an equal share of what is left."""
    n = max(1, min(n, len(params)))
    groups: list[list] = []
    i, left = 0, sum(p.numel() for p in params)
    for remaining in range(n, 0, -1):
        target = left / remaining
        group, size = [params[i]], params[i].numel()
        i += 1
        while i < len(params) - (remaining - 1) and (
                remaining == 1 or size + params[i].numel() - target <= target - size):
            group.append(params[i])
            size += params[i].numel()
            i += 1
        groups.append(group)
        left -= size
    return groups


def run_ds_steps(engine, batch: dict[str, Any], size: int, job: dict[str, Any], sync) -> dict[str, Any]:
    """The user's loop: forward, engine.backward, engine.step, timed between syncs; then the split's detail.
    With accumulation a step is `gradient_accumulation_steps` such micro-steps (engine.step after every
    backward, as DeepSpeed wants; it steps the optimizer at the last), timed as one; its loss their mean."""
    split = EngineSplit(engine, sync, detail_from=None)
    accum = job.get("grad_accum", 1)  # gradient_accumulation_steps in the engine's config
    losses: list[float] = []

    def one_step() -> bool:
        sync()
        total = 0.0
        for _ in range(accum):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total = total + loss.detach().float()
        sync()
        losses.append(float(total) / accum)
        return split.skipped[-1]

    def before_extra() -> None:
        split.start_detail()

    try:
        times, skipped, first, last = run_steps(one_step, job, before_extra)
    finally:
        split.restore()
    return {**summarise(times[first:last], skipped[first:last], size * accum), "warmup_used": first,
            "skipped_steps": sum(skipped), **split.fields(first, last), **loss_fields(losses)}


def measure_torch(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Plain PyTorch: fp32 weights, AdamW, autocast (fp16 with GradScaler, or bf16), all on the device.
    `torch-plain` under the cap (the blog's failing baseline), `torch-plain-uncapped` without (the ceiling)."""
    import torch

    sizes, device, sync = job["sizes"], job["device"], syncer(job["device"])
    base: dict[str, Any] = {"batch_size": sizes[0]}
    try:
        cap_memory(job)
        model, config, params, build_s = build_on_cpu(job)
        base.update(params=params, build_s=build_s)
        emit(PARTIAL, {"params": params, "build_s": build_s})
        t0 = time.perf_counter()
        reset_gpu_peak()
        model.to(device).train()
        cfg = train_config(job, sizes[0])  # the same lr / weight decay as the DeepSpeed config
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=cfg.weight_decay)
        init_s = round(time.perf_counter() - t0, 2)
        init_peak = end_init()
    except Exception as exc:  # an OOM while moving the weights is a result
        if not failure_fields(exc)["oom"]:
            raise
        yield {**base, **failure_fields(exc), "oom_phase": "init", **gpu_peaks(), "peak_host_gib": host_peak_gib()}
        return
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(job["precision"])
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)
    clip = cfg.grad_clip
    for size in sizes:
        rec = {"batch_size": size, "params": params, "build_s": build_s, "init_s": init_s,
               "peak_gpu_init_gib": init_peak, **({"init_shared": True} if size != sizes[0] else {})}
        parts: list[dict[str, float]] = []
        losses: list[float] = []

        def one_step() -> bool:
            sync()
            t0 = time.perf_counter()
            with torch.autocast(device_type=device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(**batch).loss
            sync()
            t1 = time.perf_counter()
            scaler.scale(loss).backward()
            sync()
            t2 = time.perf_counter()
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scale = scaler.get_scale()
            scaler.step(opt)  # the scaler skips it when the gradients hold inf/NaN
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sync()
            parts.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": time.perf_counter() - t2})
            losses.append(float(loss))
            return scaler.is_enabled() and scaler.get_scale() < scale

        try:
            batch = make_batch(job, config, size, device)
            reset_gpu_peak()
            times, skipped, first, last = run_steps(one_step, job)
        except Exception as exc:
            if not failure_fields(exc)["oom"]:
                raise
            yield {**rec, **failure_fields(exc), "oom_phase": "step", **gpu_peaks(), "peak_host_gib": host_peak_gib()}
            return
        kept = [p for p, skip in zip(parts[first:last], skipped[first:last]) if not skip]
        rec.update(summarise(times[first:last], skipped[first:last], size), **gpu_peaks(),
                   peak_host_gib=host_peak_gib(), warmup_used=first, skipped_steps=sum(skipped),
                   **({"split": median_parts(kept)} if kept else {}), **loss_fields(losses))
        yield rec
