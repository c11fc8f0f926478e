"""`fitone report RUN_DIR`: PNGs of loss, throughput and memory against step, and a summary table."""

from __future__ import annotations

import argparse

from fitone.report import write_report


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="pictures and a summary of a run from its metrics.jsonl",
                       description="Write loss.png, throughput.png and memory.png (against optimizer step) from "
                                   "RUN_DIR/metrics.jsonl and print a summary: steps, loss, samples/s, peak memory.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a `fitone train` run")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR/report/)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir, args.out))
    return 0
