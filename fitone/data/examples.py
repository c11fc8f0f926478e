"""What a tokenised example is, and the datasets of them that fitone.data builds and batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

IGNORE_INDEX = -100  # label positions the loss skips (padding)


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None  # packed rows only: restart at 0 for each example


@dataclass
class Dataset:
    """Tokenised examples (or a synthetic generator), with what was truncated while reading."""

    task: str
    examples: Sequence[Example]
    truncated: int = 0
    source: str = ""
    raw: Sequence[dict[str, Any]] = field(default=(), repr=False)  # the source rows, for scoring generations
    dropped: int = 0  # chat rows with no assistant token within --seq-len: nothing to learn, left out
    packed_from: int | None = None  # --pack: how many examples were packed into these rows

    def __len__(self) -> int:
        return len(self.examples)


class ArrowExamples(Sequence[Example]):
    """Tokenised rows in a memory-mapped Arrow table, read one example at a time."""

    def __init__(self, table):
        names = [n for n in ("input_ids", "labels", "position_ids") if n in table.column_names]
        self.table, self.rows = table, table.select_columns(names)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.rows[int(i)]
        return Example(row["input_ids"], row["labels"], row.get("position_ids"))

    def lengths(self) -> list[int]:
        """Tokens per example (inputs and, for seq2seq, targets), from their own column: no row is read."""
        return self.table["length"]
