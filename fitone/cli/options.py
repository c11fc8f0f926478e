"""Flags that map one-to-one onto TrainConfig fields, shared by train, probe-batch and plan.

Flags default to 'not given' (SUPPRESS), so only what the user typed overrides a recipe or default.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

from fitone.config import DEVICES, LR_SCHEDULES, OFFLOADS, OPTIMIZER_STATES, PRECISIONS, PREFER_BATCH, TrainConfig
from fitone.recipes import load_recipe, parse_overrides

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}

# field -> (type, help). bool fields become --flag / --no-flag.
FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "hub id, local dir, or (with --from-scratch) a shipped architecture name"),
    "from_scratch": (bool, "build the architecture from a shipped config with random weights"),
    "data": (str, "a .jsonl/.json, .csv or .parquet file or glob, a save_to_disk directory, a hub dataset id, "
                  "'sample' (shipped numbers-to-words task) or 'synthetic' (random tokens)"),
    "data_split": (str, "the split of a hub dataset (or a save_to_disk DatasetDict) to train on"),
    "data_config": (str, "the configuration (subset) of a hub dataset"),
    "chat_template": (str, "a Jinja chat template file, for chat 'messages' rows when the tokenizer has none"),
    "pack": (bool, "causal LM: concatenate whole examples into full --seq-len rows; no example attends to "
                   "another (position ids restart per example)"),
    "cache": (bool, "reuse datasets' cache of converted and tokenised data (--no-cache: redo both)"),
    "source_field": (str, "field holding the seq2seq input"),
    "target_field": (str, "field holding the seq2seq output"),
    "text_field": (str, "field holding the causal-LM text (the part the loss is taken on)"),
    "prompt_field": (str, "causal LM: a field fed before the text but not trained on (instructions, "
                          "prompts)"),
    "src_len": (int, "seq2seq: longest input in tokens; longer inputs are truncated"),
    "tgt_len": (int, "seq2seq: longest target in tokens; longer targets are truncated"),
    "seq_len": (int, "causal LM: longest text in tokens; longer texts are truncated"),
    "eval_data": (str, "held-out data (same fields and kinds as --data) scored at the end; 'sample' brings "
                       "its own"),
    "eval_split": (str, "--eval-data's split, for a hub id or DatasetDict"),
    "eval_examples": (int, "held-out examples scored at the end, the first N of the eval file (0: none)"),
    "eval_every": (int, "also score them every N optimizer steps (logged to metrics.jsonl, drawn by report)"),
    "batch_size": (str, "per-GPU micro-batch, or 'auto' to probe for the largest that fits"),
    "grad_accum": (int, "gradient-accumulation steps"),
    "global_batch": (int, "samples per optimizer step; accumulation is derived"),
    "prefer_batch": (PREFER_BATCH, "what --batch-size auto and probe-batch choose: throughput (the micro-batch and "
                                   "accumulation with the most samples/s, timed as real steps) or largest (the "
                                   "largest micro-batch that fits, less the margin)"),
    "lr": (float, "peak learning rate"),
    "lr_schedule": (LR_SCHEDULES, "constant, or linear or cosine decay to 0 over the run (after the warm-up)"),
    "warmup_steps": (int, "linear warm-up steps"),
    "weight_decay": (float, "AdamW weight decay"),
    "grad_clip": (float, "clip the gradient norm to this (0: off)"),
    "max_steps": (int, "stop after this many optimizer steps"),
    "epochs": (float, "passes over the data (when --max-steps is not given)"),
    "seed": (int, "seed for weights, data order and dropout"),
    "precision": (PRECISIONS, "fp16 (dynamic loss scaling), bf16 or fp32; auto: fp16 on a GPU, fp32 on the CPU"),
    "activation_checkpointing": (bool, "recompute activations in backward (saves GPU memory)"),
    "fused_loss": (bool, "causal LMs: fuse the LM head and the cross-entropy so no [tokens, vocab] logits are "
                         "kept; on a GPU only for vocabularies of 65,536 tokens or more (--no-fused-loss: the "
                         "model's own loss)"),
    "offload": (OFFLOADS, "where the optimizer lives: cpu (ZeRO-Offload) or none (on the GPU)"),
    "delayed_update": (bool, "run step N's CPU Adam while the GPU computes step N+1 on weights one update "
                             "old (faster, but it trains worse)"),
    "delayed_update_after": (int, "plain steps before the delayed update starts"),
    "pipelined_update": (bool, "run each step's CPU Adam and upload chunk by chunk while the next forward "
                               "runs, each layer waiting for its own weights (--no-pipelined-update: DeepSpeed's "
                               "own step; under a launcher opt-in, not yet measured on GPUs)"),
    "optimizer_states": (OPTIMIZER_STATES, "the optimizer's host state: fp32 (exact, 14 B/param), or bf16 master "
                                           "weights and moments (8 B/param; needs --precision bf16, runs the "
                                           "pipelined update) rounded stochastically (bf16) or to the nearest "
                                           "(bf16-nearest, which loses updates under ~0.2-0.4 percent of a weight), "
                                           "or to the nearest with a bf16 compensation buffer that keeps what the "
                                           "rounding lost (bf16-kahan, 10 B/param)"),
    "speculative_update": (bool, "opt-in: in the pipelined update with fp32 optimizer states, run a chunk's CPU "
                                 "Adam during the backward once its gradients are on the host; kept where the "
                                 "step then runs the same arithmetic (the same bits); redone at the step's scale "
                                 "where clipping fired, else undone in place, to fp32 rounding "
                                 "(docs/optimizer-step.md)"),
    "gpu_adam_share": (float, "on one GPU, the fraction of the pipelined update's fp32 CPU Adam chunks that the "
                              "GPU steps instead (their states go up and back down beside the CPU's work; the same "
                              "bits; ~0.35 GB of GPU memory); 0: none (docs/optimizer-step.md)"),
    "ds_config": (str, "a DeepSpeed JSON file merged over the generated config"),
    "max_gpu_memory": (str, "cap the CUDA allocator, e.g. 23GiB, to stand for a smaller card"),
    "expandable_segments": (bool, "CUDA allocator with expandable segments (less fragmentation; unless "
                                  "PYTORCH_CUDA_ALLOC_CONF is set)"),
    "device": (DEVICES, "cuda, cpu, or auto (cuda when present)"),
    "out": (str, "run directory: metrics.jsonl, checkpoints/, final/"),
    "save_every": (int, "write a checkpoint every N steps"),
    "keep_checkpoints": (int, "complete checkpoints to keep"),
    "resume": (bool, "continue from the newest complete checkpoint in --out"),
    "overwrite": (bool, "replace an existing run directory"),
    "log_every": (int, "log every N steps"),
    "report_to": (str, "also log metrics, held-out scores and the config to tensorboard, wandb, or "
                       "tensorboard,wandb (under --out; wandb runs offline without network)"),
    "verbose": (bool, "show DeepSpeed's own log lines"),
    "progress": (bool, "show a progress bar"),
    "preflight": (bool, "check host RAM against the plan before building the engine (--no-preflight skips)"),
    "max_bad_steps": (int, "stop after this many consecutive NaN/overflow steps"),
    "host_mem_warn": (float, "warn when host RAM use passes this fraction"),
    "host_mem_stop": (float, "checkpoint and stop when host RAM use passes this fraction"),
}


# defaults that need words: None means "not set" differently per field
DEFAULT_WORDS = {"pipelined_update": "on with one GPU and --offload cpu, else off",
                 "eval_split": "validation, else test"}


def default_text(name: str) -> str:
    """TrainConfig's default for a field, as --help shows it ('' where there is none to show)."""
    if name in DEFAULT_WORDS:
        return DEFAULT_WORDS[name]
    value = _DEFAULTS[name]
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_config_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    for name in names:
        kind, help_text = FLAGS[name]
        default = default_text(name)
        if default:
            # a recipe's value, when --recipe is given, replaces the default
            help_text = f"{help_text} (default: {default})"
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


def config_from_args(args: argparse.Namespace, names: Iterable[str]) -> TrainConfig:
    """Recipe values, then key=value overrides, then typed flags; `typed` names what the user gave."""
    overrides = {**parse_overrides(getattr(args, "overrides", []) or []), **given(args, names)}
    typed = set(overrides)
    if getattr(args, "recipe", None):
        recipe = load_recipe(args.recipe)
        cfg = recipe.config(**overrides)
        typed |= set(recipe.values)
    else:
        cfg = TrainConfig.from_dict(overrides)
    return dataclasses.replace(cfg, typed=tuple(sorted(typed)))
