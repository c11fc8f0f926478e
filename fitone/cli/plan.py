"""`fitone plan`: predict GPU and host memory before allocating anything (all maths in fitone.plan)."""

from __future__ import annotations

import argparse
import json
import sys

from fitone.cli.options import add_config_flags, add_recipe_arguments, config_from_args
from fitone.render import plan_text, plot_plan

FLAGS = ("model", "from_scratch", "src_len", "tgt_len", "seq_len", "pack", "batch_size", "grad_accum", "global_batch",
         "precision", "activation_checkpointing", "offload", "delayed_update", "pipelined_update",
         "optimizer_states", "speculative_update", "gpu_adam_share", "ds_config",
         "max_gpu_memory", "device")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict GPU and host memory of a run, without loading weights",
        description="Predict what a ZeRO-2 run needs on the GPU and in host RAM, from a meta-device model "
                    "(no weights, nothing allocated), and the largest micro-batch that fits. "
                    "Example: fitone plan --model t5-3b --gpu-mem 24GiB --src-len 128 --tgt-len 128",
    )
    add_recipe_arguments(parser)
    add_config_flags(parser, FLAGS)
    parser.add_argument("--gpu-mem", metavar="SIZE",
                        help="memory of the card to plan for, e.g. 24GiB or 24GB (default: this machine's GPU; "
                             "required on a machine without one)")
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="data-parallel GPUs on each node; ZeRO-2 splits optimizer states and fp32 grads over "
                             "all N x M of them (default 1)")
    parser.add_argument("--nodes", type=int, default=1, metavar="M",
                        help="machines, N GPUs each; host RAM is planned per node: its N ranks' shares (default 1)")
    parser.add_argument("--host-mem", metavar="SIZE",
                        help="one node's host RAM to plan for (default: what is available here now)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", metavar="PNG", help="also draw where the memory goes, as a stacked bar chart")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, FLAGS)  # first: a bad option costs no torch import
    from fitone.plan import plan  # here: it imports torch, which `fitone plan --help` does not need

    result = plan(cfg, gpu_mem=args.gpu_mem, gpus=args.gpus, nodes=args.nodes, host_mem=args.host_mem)
    print(json.dumps(result.to_dict(), indent=2) if args.json else plan_text(result))
    if args.plot:
        plot_plan(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
