"""Flags that map one-to-one onto TrainConfig fields, shared by train, probe-batch and plan.

Flags default to 'not given' (SUPPRESS), so only what the user typed overrides a recipe or default.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable

from fitone.config import DEVICES, LR_SCHEDULES, OFFLOADS, PRECISIONS

# field -> (type, help). bool fields become --flag / --no-flag.
FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "hub id, local dir, or (with --from-scratch) a shipped architecture name"),
    "from_scratch": (bool, "build the architecture from a shipped config with random weights"),
    "data": (str, "a JSONL file, 'sample' (shipped numbers-to-words task) or 'synthetic' (random tokens)"),
    "source_field": (str, "JSONL field holding the seq2seq input"),
    "target_field": (str, "JSONL field holding the seq2seq output"),
    "text_field": (str, "JSONL field holding the causal-LM text (the part the loss is taken on)"),
    "prompt_field": (str, "causal LM: a JSONL field fed before the text but not trained on (instructions, "
                          "prompts)"),
    "src_len": (int, "seq2seq: longest input in tokens; longer inputs are truncated"),
    "tgt_len": (int, "seq2seq: longest target in tokens; longer targets are truncated"),
    "seq_len": (int, "causal LM: longest text in tokens; longer texts are truncated"),
    "eval_data": (str, "held-out JSONL (same fields as --data) scored at the end; 'sample' brings its own"),
    "eval_examples": (int, "held-out examples scored at the end, the first N of the eval file (0: none)"),
    "eval_every": (int, "also score them every N optimizer steps (logged to metrics.jsonl, drawn by report)"),
    "batch_size": (str, "per-GPU micro-batch, or 'auto' to probe for the largest that fits"),
    "grad_accum": (int, "gradient-accumulation steps"),
    "global_batch": (int, "samples per optimizer step; accumulation is derived"),
    "lr": (float, "peak learning rate"),
    "lr_schedule": (LR_SCHEDULES, "constant, or linear or cosine decay to 0 over the run (after the warm-up)"),
    "warmup_steps": (int, "linear warm-up steps"),
    "weight_decay": (float, "AdamW weight decay"),
    "grad_clip": (float, "clip the gradient norm to this (0: off)"),
    "max_steps": (int, "stop after this many optimizer steps"),
    "epochs": (float, "passes over the data (when --max-steps is not given)"),
    "seed": (int, "seed for weights, data order and dropout"),
    "precision": (PRECISIONS, "fp16 (dynamic loss scaling), bf16 or fp32"),
    "activation_checkpointing": (bool, "recompute activations in backward (saves GPU memory)"),
    "offload": (OFFLOADS, "where the optimizer lives: cpu (ZeRO-Offload) or none (on the GPU)"),
    "delayed_update": (bool, "run step N's CPU Adam while the GPU computes step N+1 on weights one update "
                             "old (faster; off by default)"),
    "delayed_update_after": (int, "plain steps before the delayed update starts (default 20)"),
    "pipelined_update": (bool, "run each step's CPU Adam and upload chunk by chunk while the next forward "
                               "runs, each layer waiting for its own weights; on by default on one GPU with "
                               "--offload cpu (--no-pipelined-update: DeepSpeed's own step)"),
    "ds_config": (str, "a DeepSpeed JSON file merged over the generated config"),
    "max_gpu_memory": (str, "cap the CUDA allocator, e.g. 23GiB, to stand for a smaller card"),
    "expandable_segments": (bool, "CUDA allocator with expandable segments (less fragmentation; default "
                                  "on unless PYTORCH_CUDA_ALLOC_CONF is set)"),
    "device": (DEVICES, "cuda, cpu, or auto (cuda when present)"),
    "out": (str, "run directory: metrics.jsonl, checkpoints/, final/"),
    "save_every": (int, "write a checkpoint every N steps"),
    "keep_checkpoints": (int, "complete checkpoints to keep"),
    "resume": (bool, "continue from the newest complete checkpoint in --out"),
    "overwrite": (bool, "replace an existing run directory"),
    "log_every": (int, "log every N steps"),
    "verbose": (bool, "show DeepSpeed's own log lines"),
    "progress": (bool, "show a progress bar"),
    "preflight": (bool, "check host RAM against the plan before building the engine (--no-preflight skips)"),
    "max_bad_steps": (int, "stop after this many consecutive NaN/overflow steps"),
    "host_mem_warn": (float, "warn when host RAM use passes this fraction (default 0.90)"),
    "host_mem_stop": (float, "checkpoint and stop when host RAM use passes this fraction (default 0.95)"),
}


def add_config_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    for name in names:
        kind, help_text = FLAGS[name]
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, dest=name, choices=kind, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=help_text)


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The config values the user typed (flags left out are absent, not None)."""
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """--recipe NAME and key=value overrides, shared by train, probe-batch and plan."""
    parser.add_argument("--recipe",
                        help="a built-in recipe (e.g. t5-3b/24gb; `fitone recipes` lists them) or a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe values")


def config_from_args(args: argparse.Namespace, names: Iterable[str]):
    """Recipe values, then key=value overrides, then typed flags."""
    from fitone.config import TrainConfig
    from fitone.recipes import load_recipe, parse_overrides

    overrides = {**parse_overrides(getattr(args, "overrides", []) or []), **given(args, names)}
    if getattr(args, "recipe", None):
        return load_recipe(args.recipe).config(**overrides)
    return TrainConfig.from_dict(overrides)
