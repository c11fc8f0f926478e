"""`fitone train`: options -> TrainConfig (recipe, then key=value overrides, then flags) -> fitone.train."""

from __future__ import annotations

import argparse
import sys

from fitone.cli.options import FLAGS, add_config_flags, given

TRAIN_FLAGS = list(FLAGS)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune with DeepSpeed ZeRO-2 + CPU offload, in-process",
                       description="Fine-tune a model with DeepSpeed ZeRO-2 and the optimizer on the CPU. "
                                   "Recipe values < key=value overrides < flags.")
    p.add_argument("--recipe", help="a built-in recipe (e.g. t5-3b/24gb; `fitone recipes` lists them) or a YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe values")
    add_config_flags(p, TRAIN_FLAGS)
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace, names: list[str]):
    """Recipe values, then key=value overrides, then typed flags."""
    from fitone.config import TrainConfig
    from fitone.recipes import load_recipe, parse_overrides

    overrides = {**parse_overrides(getattr(args, "overrides", []) or []), **given(args, names)}
    if getattr(args, "recipe", None):
        return load_recipe(args.recipe).config(**overrides)
    return TrainConfig.from_dict(overrides)


def run(args: argparse.Namespace) -> int:
    import fitone
    from fitone.checkpoint import latest

    cfg = config_from_args(args, TRAIN_FLAGS)
    try:
        result = fitone.train(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, but say what is safe on disk
        last = latest(cfg.out) if cfg.out else None
        kept = f"; the last complete checkpoint is {last}: continue with the same command plus --resume" if last else ""
        print(f"fitone: interrupted{kept}", file=sys.stderr)
        return 130
    print(result)
    if result.final_dir:
        print(f"model saved to {result.final_dir} (load it with from_pretrained)")
    return 0
