"""metrics.jsonl: one JSON object per logged step, appended as training goes (readable mid-run)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fitone.errors import DataError


class MetricsLog:
    """Appends step records; on resume, drops records past the checkpoint so the curve has no repeats."""

    def __init__(self, path: Path | None, *, resume_step: int | None = None):
        self.path = path
        if path is None:
            return
        if resume_step is not None and path.exists():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")  # rewritten whole, then renamed: a kill keeps the old file
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"no metrics file at {path}: give a run directory written by `fitone train --out`")
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if lineno == len(lines) and not text.endswith("\n"):
                    break  # the last append was cut short by a kill: that step is simply not logged
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
    return rows
