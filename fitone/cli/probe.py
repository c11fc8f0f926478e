"""`fitone probe-batch`: the largest micro-batch that trains on this GPU, found on a real engine in minutes, and
the micro-batch x accumulation to train with (by default the one with the most samples/s, timed)."""

from __future__ import annotations

import argparse

import fitone
from fitone.cli.options import add_config_flags, add_recipe_arguments, config_from_args
from fitone.probe import search
from fitone.recipes import save_to_recipe
from fitone.render import probe_table

# the train options that decide memory (and --global-batch and --prefer-batch: the micro-batch x accumulation)
PROBE_FLAGS = ["model", "from_scratch", "data", "data_split", "data_config", "chat_template", "pack", "source_field",
               "target_field", "text_field", "prompt_field",
               "src_len", "tgt_len", "seq_len", "global_batch", "prefer_batch", "precision", "activation_checkpointing",
               "offload",
               "pipelined_update", "optimizer_states", "gpu_adam_share", "ds_config",
               "max_gpu_memory", "expandable_segments", "device", "seed", "verbose",
               "preflight"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "probe-batch", help="find the largest micro-batch that trains on this GPU (binary search on a real engine)",
        description="Build the model from its config with random weights and the same DeepSpeed engine, precision "
                    "and activation checkpointing as `fitone train`, then run full training steps on a worst-case "
                    "batch: double until out of memory, bisect, back off by --margin and verify. Then choose the "
                    "micro-batch and accumulation to train with (--prefer-batch throughput: the most samples/s for "
                    "--global-batch among a few timed as real accumulated steps; largest: the largest). The result "
                    "is saved, and `fitone train --batch-size auto` reuses it.",
        epilog="example: fitone probe-batch --model t5-3b --from-scratch --data synthetic --src-len 128 "
               "--tgt-len 128 --precision fp16 --max-gpu-memory 23GiB --json probe.json --plot probe.png")
    add_recipe_arguments(p)
    add_config_flags(p, PROBE_FLAGS)
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"largest size to try (default {search.DEFAULT_MAX_BATCH} on a GPU; needed on the CPU, where "
                        "nothing runs out of memory the way a GPU does, and bounded there by the plan's host RAM)")
    p.add_argument("--max-trials", type=int, default=search.DEFAULT_MAX_TRIALS,
                   help=f"search trials before settling (default {search.DEFAULT_MAX_TRIALS})")
    p.add_argument("--margin", type=float, default=search.DEFAULT_MARGIN,
                   help="back off from the largest fit by this fraction, for memory that varies between steps "
                        f"(fragmentation, allocator caching); in [0, 0.5), default {search.DEFAULT_MARGIN}")
    p.add_argument("--verify-steps", type=int, default=search.DEFAULT_VERIFY_STEPS,
                   help=f"steps that verify the chosen size (0: skip; default {search.DEFAULT_VERIFY_STEPS})")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", dest="plot_path", metavar="PNG", help="plot peak memory and samples/s against size")
    p.add_argument("--save", dest="save_path", metavar="RECIPE.yaml", help="write batch_size: N into this recipe")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="measure again even when a saved probe for these settings exists")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, PROBE_FLAGS)  # first: a bad option costs no torch import (the API loads it)
    result = fitone.probe_batch(cfg, max_batch=args.max_batch, max_trials=args.max_trials, margin=args.margin,
                                verify_steps=args.verify_steps, json_path=args.json_path, plot_path=args.plot_path,
                                use_cache=args.use_cache)
    print()
    print(probe_table(result))
    micro, accum = result.micro_batch, result.accumulation
    if cfg.global_batch is not None:
        print(f"for --global-batch {cfg.global_batch}: --batch-size {micro} with {accum} accumulation steps")
    print(f"train with --batch-size {micro} (or --batch-size auto, which reuses this probe)")
    if args.save_path:
        print(f"wrote batch_size: {micro} to {save_to_recipe(result, args.save_path)}")
    return 0
