"""docs/options.md, generated from the flag table (fitone.cli.options.FLAGS) and the commands' own parsers.

One source for every option: `python -m fitone.cli.reference > docs/options.md` rewrites the page, and
tests/test_docs.py fails when the page and the table part.
"""

from __future__ import annotations

import argparse

from fitone.cli import build_parser
from fitone.cli.options import FLAGS, default_text

REGENERATE = "python -m fitone.cli.reference > docs/options.md"
# what every command has, or what the page states once in its header
_SKIP = {"help", "recipe", "overrides", "run"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flag_words(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{s}`" for s in action.option_strings)
    if action.choices:
        return f"`{action.option_strings[0]} {'|'.join(map(str, action.choices))}`"
    return f"`{action.option_strings[0]} {action.metavar or action.dest.upper()}`"


def _is_config_flag(action: argparse.Action) -> bool:
    # a command's own option may share a field's dest (report's --out), not its help
    return action.dest in FLAGS and (action.help or "").startswith(FLAGS[action.dest][1])


def _config_rows(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    by_dest = {c: {a.dest: a for a in p._actions if _is_config_flag(a)} for c, p in parsers.items()}
    rows = []
    for name, (_, help_text) in FLAGS.items():
        commands = [c for c, actions in by_dest.items() if name in actions]
        action = next(by_dest[c][name] for c in commands)
        rows.append(f"| {_cell(_flag_words(action))} | `{name}` | {_cell(default_text(name)) or '–'} | "
                    f"{', '.join(commands)} | {_cell(help_text)} |")
    return rows


def _own_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if action.dest in _SKIP or _is_config_flag(action) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                rows.append(f"| `{choice.dest}` | {_cell(choice.help or '')} |")
            continue
        if action.option_strings:
            flag = " / ".join(f"`{s}`" for s in action.option_strings) if action.nargs == 0 else \
                f"`{action.option_strings[0]} {action.metavar or action.dest.upper()}`"
        else:
            flag = f"`{action.metavar or action.dest}`"
        rows.append(f"| {_cell(flag)} | {_cell(action.help or '')} |")
    return rows


def options_page() -> str:
    """The whole of docs/options.md."""
    parsers = _command_parsers()
    lines = [
        "# Options",
        "",
        f"Generated from the flag table in `fitone/cli/options.py`: `{REGENERATE}` rewrites this page "
        "(tests/test_docs.py fails when it is stale). Do not edit it by hand.",
        "",
        "## Training options",
        "",
        "Each is a field of `fitone.TrainConfig`: a flag (`--batch-size`), a recipe key or `key=value` override "
        "(`batch_size=64`) and a keyword argument of `fitone.train`, `fitone.probe_batch` and `fitone.plan`. "
        "Recipe values < `key=value` < flags. A yes/no option is `--flag` / `--no-flag`. The last column "
        "names the commands that take it.",
        "",
        "| flag | key | default | commands | meaning |",
        "|---|---|---|---|---|",
        *_config_rows(parsers),
        "",
        "`train`, `probe-batch` and `plan` also take `--recipe NAME` (a built-in recipe, `fitone recipes` lists "
        "them, or a YAML file) and `key=value` overrides.",
    ]
    for name, parser in parsers.items():
        rows = _own_rows(parser)
        if rows:
            lines += ["", f"## `fitone {name}`: its own options", "", "| option | meaning |", "|---|---|", *rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_page(), end="")
