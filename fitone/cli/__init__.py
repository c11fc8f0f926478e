"""The `fitone` command: a thin layer over the Python API. argparse lives only in this package.

Each command is a module with `add_parser(subparsers)` and `run(args) -> int`. `dispatch(argv)` takes
argv explicitly so tests call it directly; `main` turns FitoneError into one line and an exit code.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from fitone import __version__
from fitone.errors import FitoneError

# command name -> module under fitone.cli
COMMANDS = {
    "train": "train",
    "probe-batch": "probe",
    "plan": "plan",
    "recipes": "recipes",
    "report": "report",
}


class Parser(argparse.ArgumentParser):
    """argparse, with the nearest flag of the command suggested for one it does not know."""

    def parse_args(self, args=None, namespace=None):  # argparse's signature
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(parsed)
            command.error(f"unrecognized arguments: {' '.join(extras)}{nearest_flag(extras, command)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self


def nearest_flag(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """'; did you mean --batch-size?' for the first unknown flag that is close to one the parser has."""
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for word in unknown:
        if word.startswith("--"):
            near = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.7)
            if near:
                return f"; did you mean {near[0]}?"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
