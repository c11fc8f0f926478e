"""`fitone train`: options -> TrainConfig (recipe, then key=value overrides, then flags) -> fitone.train."""

from __future__ import annotations

import argparse
import os
import sys

import fitone
from fitone.cli.options import FLAGS, add_config_flags, add_recipe_arguments, config_from_args

TRAIN_FLAGS = list(FLAGS)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune with DeepSpeed ZeRO-2 + CPU offload, in-process",
                       description="Fine-tune a model with DeepSpeed ZeRO-2 and the optimizer on the CPU. "
                                   "Recipe values < key=value overrides < flags.")
    add_recipe_arguments(p)
    add_config_flags(p, TRAIN_FLAGS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, TRAIN_FLAGS)  # first: a bad option costs no torch import (the API loads it)
    from fitone.checkpoint import latest  # here: it imports torch, which `fitone train --help` does not need

    try:
        result = fitone.train(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, but say what is safe on disk
        last = latest(cfg.out) if cfg.out else None
        kept = f"; the last complete checkpoint is {last}: continue with the same command plus --resume" if last else ""
        print(f"fitone: interrupted{kept}", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun/deepspeed only rank 0 reports
        print(result)
        if result.final_dir:
            print(f"model saved to {result.final_dir} (load it with from_pretrained)")
    return 0

