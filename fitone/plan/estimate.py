"""`plan()` and `preflight()`: a Plan of a resolved run (fitone.run), for this machine or a card the user names."""

from __future__ import annotations

import dataclasses
from typing import Any

from fitone import memory
from fitone.config import TrainConfig, dividing
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.loss import backend_for
from fitone.run import Run, resolve_planned
from fitone.zero2 import step_mode
from fitone.plan.activations import Lengths
from fitone.plan.advice import DOES_NOT_FIT, FITS_WITH_OFFLOAD, _judge, sixteen_bit_states_fix
from fitone.plan.components import (CUDA_CONTEXT, _deepspeed_estimate, _gpu_components, _gpu_init_components,
                                    _host_components, _largest_batch, _Setup)
from fitone.plan.result import Plan, _g
from fitone.plan.shape import model_shape
from fitone.units import parse_size


def plan(
    cfg: TrainConfig | None = None,
    *,
    gpu_mem: int | str | None = None,
    gpus: int = 1,
    nodes: int = 1,
    host_mem: int | str | None = None,
    **overrides: Any,
) -> Plan:
    """Predict GPU and host memory for `cfg` (or `TrainConfig(**overrides)`) without allocating the model.

    gpu_mem: the card to plan for ('24GiB'); default this machine's GPU. --max-gpu-memory, when set,
    caps it. Without either and without a GPU, raises ConfigError. host_mem: one node's host RAM to plan
    for; default what is available here now. gpus: data-parallel ranks on each of `nodes` machines (ZeRO-2
    partitions optimizer states over all gpus x nodes; each node's host holds its own gpus ranks' share).
    """
    cfg = TrainConfig.with_overrides(cfg, overrides)
    cfg.check_paths()  # once per plan: its searches replace the settings many times
    for flag, value in (("--gpus", gpus), ("--nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive whole number, got {value!r}")
    run = resolve_planned(cfg, gpus, nodes).with_given_batch()
    limit, source = _gpu_limit(run, gpu_mem)
    if limit is None:
        raise ConfigError("no GPU on this machine to plan for: pass --gpu-mem SIZE, the memory of the card "
                          "you will train on (e.g. --gpu-mem 24GiB)")
    return _make_plan(run, micro_batch=run.micro_batch, accumulation=_accumulation(run), gpu_limit=limit,
                      gpu_limit_source=source, host_available=_host_available(host_mem))


def preflight(run: Run) -> Plan:
    """The refusals the plan can make from the config alone, run before any weights, probe or engine
    exist: raise MemoryBudgetError (one line, exit 2) when host RAM cannot hold the run (at its micro-batch;
    1 while an 'auto' one is unknown), or when the GPU cannot hold it even at micro-batch 1 (weights, states,
    buffers; the plan's verdict at size 1), instead of the kernel's OOM killer or a CUDA OOM inside DeepSpeed
    minutes later."""
    on_gpu = run.on_gpu
    micro_batch = run.micro_batch or 1
    p = _preflight_plan(run, micro_batch, _accumulation(run))
    need = _host_need(p, on_gpu)
    if need > p.host_available:
        fixes = ["a machine with more host RAM"]
        if p.offload and p.gpu_limit is not None and p.gpu_total_without_offload <= p.gpu_limit:
            fixes.append("--offload none (the GPU can hold the optimizer states)")
        if p.host_export_16bit_states is not None:
            fixes.append(sixteen_bit_states_fix(p, need - p.host_export + p.host_export_16bit_states))
        pinned = sum(c.bytes for c in p.host if c.name == "pinned rounding")
        if pinned > 0.05 * need:
            fixes.append(f"\"pin_memory\": false under offload_optimizer in --ds-config (saves {_g(pinned):.1f} GiB)")
        fixes.append("a smaller model")
        raise MemoryBudgetError(
            f"host RAM too small: this run needs {_g(need):.1f} GiB ({_g(p.host_states):.1f} GiB of offloaded "
            f"states per rank{f' x {p.gpus} ranks on this node' if p.gpus > 1 else ''} + baseline + one export shard"
            f"{'' if on_gpu else ' + the model, buckets and activations a CPU run keeps there'}"
            f") but {_g(p.host_available):.1f} GiB is available, {_g(need - p.host_available):.1f} GiB short; "
            f"use {', or '.join(fixes)}"
        )
    if p.gpu_limit is not None:
        # the plan's verdict at the smallest micro-batch: whatever it counts (weights, buckets, optimizer
        # states, init peak) must fit before a probe or the user's batch size can matter
        at_one = p if micro_batch == 1 else _preflight_plan(run, 1, run.with_batch(1).accumulation)
        if "GPU" in at_one.short:
            fixes = []
            if not at_one.offload and at_one.verdict == FITS_WITH_OFFLOAD:
                fixes.append("--offload cpu (the optimizer states move to host RAM)")
            if not at_one.activation_checkpointing:
                fixes.append("--activation-checkpointing")
            if run.cap_bytes is not None:
                fixes.append("a larger --max-gpu-memory")
            fixes += ["a GPU with more memory", "a smaller model"]
            raise MemoryBudgetError(
                f"does not fit on the GPU even at micro-batch 1: the plan needs {_g(at_one.gpu_peak):.1f} GiB "
                f"at its {at_one.gpu_peak_phase} ({_g(at_one.by_category('gpu')['weights']):.1f} GiB of weights) "
                f"of {_g(at_one.gpu_limit):.1f} GiB "
                f"({at_one.gpu_limit_source}), {_g(at_one.short['GPU']):.1f} GiB short; use {', or '.join(fixes)} "
                "(`fitone plan` shows where the memory goes; --no-preflight tries anyway)"
            )
    return p


def host_micro_batch_bound(run: Run) -> int:
    """The largest micro-batch whose run the plan fits in available host RAM (0: not even 1). On a CPU,
    where nothing runs out of memory the way a GPU does, this is what bounds a batch-size search."""
    probe = run.for_probe()  # as a probe runs: one GPU, every step an optimizer step
    return _largest_batch(
        lambda b: _host_need(p := _preflight_plan(probe, b, 1), run.on_gpu) <= p.host_available, 64)


def _accumulation(run: Run) -> int:
    """The run's accumulation; an 'auto' micro-batch's as at micro-batch 1."""
    return (run if run.micro_batch is not None else run.with_batch(1)).accumulation


def _preflight_plan(run: Run, micro_batch: int, accumulation: int) -> Plan:
    limit, source = _gpu_limit(run, None) if run.on_gpu else (None, "no GPU: not checked")
    return _make_plan(run, micro_batch=micro_batch, accumulation=accumulation, gpu_limit=limit,
                      gpu_limit_source=source or "", host_available=_host_available(None))


def _largest_dividing(cfg: TrainConfig, most: int, world: int) -> tuple[int, int]:
    """The largest micro-batch <= `most` whose accumulation --global-batch divides exactly, and that accumulation
    (TrainConfig.accumulation, the one owner of it); a global batch no micro-batch above 1 divides gets 1."""
    above_one = (pair for pair in dividing(most, lambda b: cfg.accumulation(b, world)) if pair[0] > 1)
    return next(above_one, (1, max(1, cfg.global_batch // world)))


def _host_need(p: Plan, on_gpu: bool) -> int:
    """This node's host RAM: its ranks' (p.gpus) shares, not every rank's. On a CPU run the "GPU" side (weights,
    buckets, activations) lives in host RAM too."""
    return p.host_export + (0 if on_gpu else p.gpus * p.gpu_allocated)


def _gpu_limit(run: Run, gpu_mem: int | str | None) -> tuple[int | None, str]:
    """Card-equivalent bytes the GPU peak must stay under, and where that number came from."""
    card = parse_size(gpu_mem, "--gpu-mem")
    source = f"--gpu-mem {gpu_mem}" if card else ""
    if card is None and memory.cuda_ready():
        total, free = memory.gpu_total_bytes(), memory.gpu_free_bytes()
        card = min(total, free + CUDA_CONTEXT)  # our own context is already out of `free`
        source = f"this machine's {memory.gpu_name()}"
    cap = run.cap_bytes  # the cap is the allocator's: the CUDA context comes on top (the one place it is added)
    if cap is not None and (card is None or cap + CUDA_CONTEXT < card):
        return cap + CUDA_CONTEXT, f"--max-gpu-memory {run.settings.max_gpu_memory} + CUDA context"
    return card, source


def _host_total_16bit_states(st: _Setup, offload: bool) -> int | None:
    """The host total of this run under --optimizer-states bf16 (and so bf16 training in the pipelined update),
    where that option could run and is not given."""
    if not offload or st.gpus > 1 or st.optimizer_states != "fp32":
        return None
    alt = dataclasses.replace(st, precision="bf16", optimizer_states="bf16", pipelined_update=True)
    return sum(c.bytes for c in _host_components(alt, True))


def _host_available(host_mem: int | str | None) -> int:
    # this process's own memory comes back when `fitone plan` exits, and in train it is the baseline
    return parse_size(host_mem, "--host-mem") or memory.host_available_bytes() + memory.host_rss_bytes()


def _make_plan(run: Run, *, micro_batch: int | None, accumulation: int, gpu_limit: int | None,
               gpu_limit_source: str, host_available: int) -> Plan:
    """The plan of `run` at `micro_batch` (None: 'auto', the largest that fits) with `accumulation`."""
    # ZeRO-2 partitions over every rank (gpus); a node's host holds its own ranks' partitions (here)
    cfg, config, on_gpu, gpus, here = run.settings, run.model_config, run.on_gpu, run.world_size, run.dist.ranks_on_node
    nodes = run.dist.nodes
    shape, notes = model_shape(cfg, config)
    notes = [*run.config_notes, *notes]
    lengths = Lengths(cfg.src_len, cfg.tgt_len) if shape.encoder_decoder else Lengths(cfg.seq_len, cfg.seq_len)
    if cfg.pack and shape.encoder_decoder:
        raise ConfigError(f"--pack is for causal LMs; {cfg.model} is seq2seq: drop --pack")
    if cfg.pack and shape.pack_refusal:
        raise ConfigError(shape.pack_refusal)
    if cfg.pack:  # the lengths above are the worst case of padded batches, and every packed batch's
        notes = [*notes, f"--pack: every batch is full ({cfg.seq_len} tokens per row), so every step takes this memory"]
    auto = micro_batch is None
    ds = run.ds_sections
    zero = ds.get("zero_optimization", {})
    offload_cfg = zero.get("offload_optimizer") or {}
    offload = offload_cfg.get("device") == "cpu"
    st = _Setup(shape=shape, precision=run.precision, checkpointing=cfg.activation_checkpointing, lengths=lengths,
                gpus=gpus, accumulation=int(ds.get("gradient_accumulation_steps", accumulation)),
                bucket=int(float(zero.get("reduce_bucket_size", 5e8))), overlap_comm=bool(zero.get("overlap_comm")),
                pin_memory=bool(offload_cfg.get("pin_memory", False)), on_gpu=on_gpu,
                delayed_update=cfg.delayed_update,
                fused_loss=backend_for(shape.model_type, device=run.device, precision=run.precision,
                                       encoder_decoder=shape.encoder_decoder,
                                       router_loss=bool(getattr(config, "output_router_logits", False)),
                                       vocab_size=shape.vocab)
                if cfg.fused_loss else None,
                pipelined_update=run.mode.name == step_mode.PIPELINED, optimizer_states=run.mode.states,
                speculative_update=run.mode.engine_options()["speculative"],
                gpu_share=run.mode.engine_options()["gpu_share"])

    def gpu_peak(b: int, off: bool, setup: _Setup = st) -> int:
        """The GPU peak at micro-batch b: a step's, or the engine init's where that is higher."""
        return max(sum(c.bytes for c in _gpu_components(setup, off, b)),
                   sum(c.bytes for c in _gpu_init_components(setup, off)))

    def max_batch(off: bool, setup: _Setup = st, accumulating: bool | None = None) -> int | None:
        """The largest micro-batch that fits: at the run's accumulation, or accumulating or not as asked."""
        if gpu_limit is None:
            return None

        def largest(a: int) -> int:
            return _largest_batch(lambda b: gpu_peak(b, off, dataclasses.replace(setup, accumulation=a)) <= gpu_limit,
                                  64)

        if accumulating is not None:
            return largest(2 if accumulating else 1)
        if per_step is None:  # the accumulation is fixed (--grad-accum, or 1)
            return largest(setup.accumulation)
        # with --global-batch G the accumulation follows the micro-batch: G / b > 1 below G, 1 at G
        return per_step if largest(1) >= per_step else min(largest(2), per_step)

    per_step = None if cfg.global_batch is None else max(1, cfg.global_batch // gpus)
    best = max_batch(offload)
    if micro_batch is None:  # 'auto': the largest that fits; with a global batch, the largest that divides it
        micro_batch = max(1, best or 1)
        if per_step is not None:
            micro_batch, accum = _largest_dividing(cfg, min(micro_batch, per_step), gpus)
            st = dataclasses.replace(st, accumulation=accum)
    host = _host_components(st, offload)
    host_total = here * sum(c.bytes for c in host)
    host_no = here * sum(c.bytes for c in _host_components(st, False))
    gpu = _gpu_components(st, offload, micro_batch)
    p = Plan(
        model=cfg.model or "", family=shape.family, n_params=shape.n_params, precision=run.precision,
        offload=offload, gpus=here, world_size=gpus, nodes=nodes, micro_batch=micro_batch,
        lengths={"src_len": lengths.src, "tgt_len": lengths.tgt} if shape.encoder_decoder else {"seq_len": lengths.src},
        activation_checkpointing=cfg.activation_checkpointing, gpu=gpu, host=host,
        gpu_total=sum(c.bytes for c in gpu), host_total=host_total, gpu_limit=gpu_limit,
        gpu_limit_source=gpu_limit_source, host_available=host_available,
        activation_per_sample=st.per_sample(), activation_per_sample_ckpt=st.per_sample(True),
        activation_per_sample_no_ckpt=st.per_sample(False), max_micro_batch=best,
        max_micro_batch_without_offload=max_batch(False), gpu_total_without_offload=gpu_peak(micro_batch, False),
        host_total_without_offload=host_no, verdict=DOES_NOT_FIT, notes=notes,
        deepspeed_estimate=_deepspeed_estimate(shape.n_params, here, nodes, offload),
        gpu_init=_gpu_init_components(st, offload), optimizer_states=run.mode.states,
        host_total_16bit_states=_host_total_16bit_states(st, offload),
        max_micro_batch_one_step=max_batch(offload, accumulating=False),
    )
    # an 'auto' micro-batch is probed later: it fits if a micro-batch of 1 does
    _judge(p, st, gpu_peak, max_batch, judge_at=1 if auto else micro_batch)
    return p
