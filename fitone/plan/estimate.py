"""`plan()` and `preflight()`: a Plan from a TrainConfig, for this machine or a card the user names."""

from __future__ import annotations

from typing import Any

from fitone import memory
from fitone.config import TrainConfig, resolve_precision
from fitone.errors import ConfigError, MemoryBudgetError
from fitone.loss import backend_for
from fitone.zero2 import step_mode
from fitone.zero2.step_mode import StepMode
from fitone.plan.activations import Lengths
from fitone.plan.advice import DOES_NOT_FIT, FITS_WITH_OFFLOAD, _judge
from fitone.plan.components import (CUDA_CONTEXT, Plan, _deepspeed_estimate, _g, _gpu_components,
                                    _gpu_init_components, _host_components, _largest_batch, _Setup)
from fitone.plan.shape import model_shape
from fitone.units import parse_size


def plan(
    cfg: TrainConfig | None = None,
    *,
    gpu_mem: int | str | None = None,
    gpus: int = 1,
    host_mem: int | str | None = None,
    **overrides: Any,
) -> Plan:
    """Predict GPU and host memory for `cfg` (or `TrainConfig(**overrides)`) without allocating the model.

    gpu_mem: the card to plan for ('24GiB'); default this machine's GPU. --max-gpu-memory, when set,
    caps it. Without either and without a GPU, raises ConfigError. host_mem: host RAM to plan for;
    default what is available now. gpus: data-parallel ranks (ZeRO-2 partitions optimizer states).
    """
    cfg = TrainConfig.with_overrides(cfg, overrides)
    cfg.check_paths()  # once per plan: its searches replace the settings many times
    limit, source = _gpu_limit(cfg, gpu_mem)
    if limit is None:
        raise ConfigError("no GPU on this machine to plan for: pass --gpu-mem SIZE, the memory of the card "
                          "you will train on (e.g. --gpu-mem 24GiB)")
    return _make_plan(cfg, gpus=gpus, gpu_limit=limit, gpu_limit_source=source,
                      host_available=_host_available(host_mem), on_gpu=cfg.device != "cpu")


def preflight(cfg: TrainConfig, *, micro_batch: int, world_size: int = 1, config: Any = None,
              mode: StepMode | None = None) -> Plan:
    """The refusals the plan can make from the config alone, run before any weights, probe or engine
    exist: raise MemoryBudgetError (one line, exit 2) when host RAM cannot hold the run, or when the GPU
    cannot hold it even at micro-batch 1 (weights, states, buffers; the plan's verdict at size 1),
    instead of the kernel's OOM killer or a CUDA OOM inside DeepSpeed minutes later.
    `config` and `mode`: the model config and step a run already loaded and decided (else done here)."""
    on_gpu = _runs_on_gpu(cfg)
    p = _preflight_plan(cfg, micro_batch, world_size, on_gpu, config, mode)
    need = _host_need(p, on_gpu)
    if need > p.host_available:
        fixes = ["a machine with more host RAM"]
        if p.offload and p.gpu_limit is not None and p.gpu_total_without_offload <= p.gpu_limit:
            fixes.append("--offload none (the GPU can hold the optimizer states)")
        pinned = sum(c.bytes for c in p.host if c.name == "pinned rounding")
        if pinned > 0.05 * need:
            fixes.append(f"\"pin_memory\": false under offload_optimizer in --ds-config (saves {_g(pinned):.1f} GiB)")
        fixes.append("a smaller model")
        raise MemoryBudgetError(
            f"host RAM too small: this run needs {_g(need):.1f} GiB ({_g(p.host_states):.1f} GiB of offloaded "
            f"states per rank + baseline + one export shard"
            f"{'' if on_gpu else ' + the model, buckets and activations a CPU run keeps there'}"
            f") but {_g(p.host_available):.1f} GiB is available, {_g(need - p.host_available):.1f} GiB short; "
            f"use {', or '.join(fixes)}"
        )
    if p.gpu_limit is not None:
        # the plan's verdict at the smallest micro-batch: whatever it counts (weights, buckets, optimizer
        # states, init peak) must fit before a probe or the user's batch size can matter
        at_one = p if micro_batch == 1 else _preflight_plan(cfg, 1, world_size, on_gpu, config, mode)
        if "GPU" in at_one.short:
            fixes = []
            if not at_one.offload and at_one.verdict == FITS_WITH_OFFLOAD:
                fixes.append("--offload cpu (the optimizer states move to host RAM)")
            if not at_one.activation_checkpointing:
                fixes.append("--activation-checkpointing")
            if cfg.max_gpu_memory:
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


def host_micro_batch_bound(cfg: TrainConfig, *, config: Any = None, mode: StepMode | None = None) -> int:
    """The largest micro-batch whose run the plan fits in available host RAM (0: not even 1). On a CPU,
    where nothing runs out of memory the way a GPU does, this is what bounds a batch-size search."""
    on_gpu = _runs_on_gpu(cfg)
    one_step = cfg.replace(global_batch=None, grad_accum=None)  # as a probe runs: every step an optimizer step
    one_gpu = mode.on_one_gpu() if mode is not None else None
    return _largest_batch(
        lambda b: _host_need(p := _preflight_plan(one_step, b, 1, on_gpu, config, one_gpu), on_gpu) <= p.host_available,
        64)


def _runs_on_gpu(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and memory.cuda_ready())


def _preflight_plan(cfg: TrainConfig, micro_batch: int, world_size: int, on_gpu: bool, config: Any = None,
                    mode: StepMode | None = None) -> Plan:
    limit, source = _gpu_limit(cfg, None) if on_gpu else (None, "no GPU: not checked")
    return _make_plan(cfg.replace(batch_size=micro_batch), gpus=world_size, gpu_limit=limit,
                      gpu_limit_source=source or "", host_available=_host_available(None), on_gpu=on_gpu,
                      config=config, mode=mode)


def _host_need(p: Plan, on_gpu: bool) -> int:
    # on a CPU run the "GPU" side (weights, buckets, activations) lives in host RAM too
    return p.host_export + (0 if on_gpu else p.gpus * p.gpu_allocated)


def _gpu_limit(cfg: TrainConfig, gpu_mem: int | str | None) -> tuple[int | None, str]:
    """Card-equivalent bytes the GPU peak must stay under, and where that number came from."""
    card = parse_size(gpu_mem, "--gpu-mem")
    source = f"--gpu-mem {gpu_mem}" if card else ""
    if card is None and memory.cuda_ready():
        total, free = memory.gpu_total_bytes(), memory.gpu_free_bytes()
        card = min(total, free + CUDA_CONTEXT)  # our own context is already out of `free`
        source = f"this machine's {memory.gpu_name()}"
    cap = cfg.max_gpu_memory_bytes
    if cap is not None and (card is None or cap + CUDA_CONTEXT < card):
        return cap + CUDA_CONTEXT, f"--max-gpu-memory {cfg.max_gpu_memory} + CUDA context"
    return card, source


def _host_available(host_mem: int | str | None) -> int:
    # this process's own memory comes back when `fitone plan` exits, and in train it is the baseline
    return parse_size(host_mem, "--host-mem") or memory.host_available_bytes() + memory.host_rss_bytes()


def _make_plan(cfg: TrainConfig, *, gpus: int, gpu_limit: int | None, gpu_limit_source: str,
               host_available: int, on_gpu: bool, config: Any = None, mode: StepMode | None = None) -> Plan:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus must be a positive whole number, got {gpus!r}")
    cfg = cfg.replace(precision=resolve_precision(cfg.precision, on_gpu))  # an 'auto' precision, as training picks it
    shape, notes = model_shape(cfg, config)
    lengths = Lengths(cfg.src_len, cfg.tgt_len) if shape.encoder_decoder else Lengths(cfg.seq_len, cfg.seq_len)
    if cfg.pack and shape.encoder_decoder:
        raise ConfigError(f"--pack is for causal LMs; {cfg.model} is seq2seq: drop --pack")
    if cfg.pack and shape.pack_refusal:
        raise ConfigError(shape.pack_refusal)
    if cfg.pack:  # the lengths above are the worst case of padded batches, and every packed batch's
        notes = [*notes, f"--pack: every batch is full ({cfg.seq_len} tokens per row), so every step takes this memory"]
    auto = cfg.batch_size == "auto"
    from fitone.ds_config import build_ds_config

    ds = build_ds_config(cfg, micro_batch=1 if auto else int(cfg.batch_size), world_size=gpus, on_gpu=on_gpu)
    zero = ds.get("zero_optimization", {})
    offload_cfg = zero.get("offload_optimizer") or {}
    offload = offload_cfg.get("device") == "cpu"
    st = _Setup(shape=shape, precision=cfg.precision, checkpointing=cfg.activation_checkpointing, lengths=lengths,
                gpus=gpus, accumulation=int(ds.get("gradient_accumulation_steps", 1)),
                bucket=int(float(zero.get("reduce_bucket_size", 5e8))), overlap_comm=bool(zero.get("overlap_comm")),
                pin_memory=bool(offload_cfg.get("pin_memory", False)), on_gpu=on_gpu,
                delayed_update=cfg.delayed_update,
                fused_loss=backend_for(shape.model_type, device="cuda" if on_gpu else "cpu", precision=cfg.precision,
                                       encoder_decoder=shape.encoder_decoder,
                                       router_loss=bool(getattr(config, "output_router_logits", False)))
                if cfg.fused_loss else None,
                pipelined_update=(mode or step_mode.for_config(cfg, world_size=gpus, on_gpu=on_gpu, ds=ds)).name
                == step_mode.PIPELINED)

    def gpu_peak(b: int, off: bool, setup: _Setup = st) -> int:
        """The GPU peak at micro-batch b: a step's, or the engine init's where that is higher."""
        return max(sum(c.bytes for c in _gpu_components(setup, off, b)),
                   sum(c.bytes for c in _gpu_init_components(setup, off)))

    def max_batch(off: bool, setup: _Setup = st) -> int | None:
        if gpu_limit is None:
            return None
        return _largest_batch(lambda b: gpu_peak(b, off, setup) <= gpu_limit, 64)

    best = max_batch(offload)
    micro_batch = max(1, best or 1) if auto else int(cfg.batch_size)
    host = _host_components(st, offload)
    host_total = gpus * sum(c.bytes for c in host)
    host_no = gpus * sum(c.bytes for c in _host_components(st, False))
    gpu = _gpu_components(st, offload, micro_batch)
    p = Plan(
        model=cfg.model or "", family=shape.family, n_params=shape.n_params, precision=cfg.precision,
        offload=offload, gpus=gpus, micro_batch=micro_batch,
        lengths={"src_len": lengths.src, "tgt_len": lengths.tgt} if shape.encoder_decoder else {"seq_len": lengths.src},
        activation_checkpointing=cfg.activation_checkpointing, gpu=gpu, host=host,
        gpu_total=sum(c.bytes for c in gpu), host_total=host_total, gpu_limit=gpu_limit,
        gpu_limit_source=gpu_limit_source, host_available=host_available,
        activation_per_sample=st.per_sample(), activation_per_sample_ckpt=st.per_sample(True),
        activation_per_sample_no_ckpt=st.per_sample(False), max_micro_batch=best,
        max_micro_batch_without_offload=max_batch(False), gpu_total_without_offload=gpu_peak(micro_batch, False),
        host_total_without_offload=host_no, verdict=DOES_NOT_FIT, notes=notes,
        deepspeed_estimate=_deepspeed_estimate(shape.n_params, gpus, offload),
        gpu_init=_gpu_init_components(st, offload),
    )
    # an 'auto' micro-batch is probed later: it fits if a micro-batch of 1 does
    _judge(p, st, gpu_peak, max_batch, judge_at=1 if auto else micro_batch)
    return p
