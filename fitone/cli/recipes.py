"""`fitone recipes`: list the built-in recipes, show one, or copy one out to edit."""

from __future__ import annotations

import argparse

from fitone.recipes import copy_recipe, list_recipes, load_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("recipes", help="list, show or copy the built-in recipes (model x GPU class)",
                       description="Built-in recipes: recipes/<model>/<gpu-class>.yaml, flat train options. "
                                   "Run one with `fitone train --recipe NAME [key=value ...]`.")
    actions = p.add_subparsers(dest="action", metavar="[list | show NAME | copy NAME DEST]")
    actions.add_parser("list", help="one line per recipe (the default)")
    show = actions.add_parser("show", help="print a recipe file: the command that runs it, what was measured, values")
    show.add_argument("name", help="e.g. t5-3b/24gb")
    copy = actions.add_parser("copy", help="copy a recipe to edit it; never overwrites")
    copy.add_argument("name", help="e.g. t5-3b/24gb")
    copy.add_argument("dest", help="a file path, or a directory (the copy is named <model>-<gpu-class>.yaml)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "show":
        print(load_recipe(args.name).path.read_text(), end="")
    elif args.action == "copy":
        dest = copy_recipe(args.name, args.dest)
        print(f"copied {args.name} to {dest}; edit it, then: fitone train --recipe {dest}")
    else:
        recipes = list_recipes()
        rows = [("NAME", "MODEL", "GPU", "BATCH", "MEASURED")]
        rows += [(r.name, r.model, r.gpu_class, r.batch, r.measured or "not measured") for r in recipes]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
        print("\nBATCH: the file's micro-batch x accumulation; MEASURED: the header's run, at its own micro-batch")
        print("fitone recipes show NAME | fitone recipes copy NAME DEST | fitone train --recipe NAME key=value")
    return 0
