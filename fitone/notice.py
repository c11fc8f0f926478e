"""One line to the user from the main process only: under a launcher every rank runs the same code, and a notice
printed by each would say it once per rank."""

from __future__ import annotations

import os


def say(text: str) -> None:
    """Print `fitone: text` on rank 0 (RANK unset: a single process, which is rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"fitone: {text}", flush=True)
