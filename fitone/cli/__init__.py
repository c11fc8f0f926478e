"""The `fitone` command: a thin layer over the Python API. argparse lives only in this package.

Each command is a module with `add_parser(subparsers)` and `run(args) -> int`. `dispatch(argv)` takes
argv explicitly so tests call it directly; `main` turns FitoneError into one line and an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fitone.errors import FitoneError

# command name -> module under fitone.cli
COMMANDS = {
    "train": "train",
    "probe-batch": "probe",
    "plan": "plan",
    "recipes": "recipes",
    "report": "report",
}


def build_parser() -> argparse.ArgumentParser:
    from fitone import __version__

    parser = argparse.ArgumentParser(
        prog="fitone", description="Fine-tune models too big for one GPU on one GPU (DeepSpeed ZeRO-2 + CPU offload)."
    )
    parser.add_argument("--version", action="version", version=f"fitone {__version__}")
    # DeepSpeed's launcher runs `python -m fitone --local_rank=N train ...` (unless --no_local_rank); the
    # rank also arrives as LOCAL_RANK in the environment, which is what fitone reads, so the flag is dropped.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(f"fitone.cli.{module}").add_parser(sub)
    return parser


def dispatch(argv: list[str]) -> int:
    """Parse argv and run the command; FitoneError propagates (main prints it)."""
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    try:
        return dispatch(sys.argv[1:] if argv is None else argv)
    except FitoneError as exc:
        if getattr(exc, "show_traceback", False):  # --verbose on a failure fitone did not foresee
            import traceback

            traceback.print_exception(exc)
        print(f"fitone: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fitone: interrupted", file=sys.stderr)
        return 130
    finally:
        if argv is None:  # the `fitone` process ends here; an in-process caller keeps its group
            _leave_process_group()


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
