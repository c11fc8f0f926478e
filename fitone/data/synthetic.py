"""`--data synthetic`: random tokens at the maximum lengths, for benchmarks and the probe's worst case."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fitone.data.examples import Example
from fitone.models import CAUSAL

SYNTHETIC_SIZE = 1 << 20  # examples; generated on demand from the seed


class SyntheticExamples(Sequence[Example]):
    """Fixed-length random tokens, deterministic per index; costs no memory for a large count."""

    def __init__(self, task: str, vocab: int, src_len: int, tgt_len: int, seed: int, size: int = SYNTHETIC_SIZE):
        self.task, self.vocab, self.seed, self.size = task, vocab, seed, size
        self.src_len, self.tgt_len = src_len, tgt_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        src = torch.randint(3, self.vocab, (self.src_len,), generator=g).tolist()
        if self.task == CAUSAL:
            return Example(src, list(src))
        return Example(src, torch.randint(3, self.vocab, (self.tgt_len,), generator=g).tolist())
