"""Tokenised examples -> padded (or packed) batches: a seeded order per epoch, so a resumed run sees exactly the
batches it would have, and the worst-case batch the probe measures."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from fitone.config import DataSettings
from fitone.data.examples import IGNORE_INDEX, ArrowExamples, Dataset, Example
from fitone.data.synthetic import SyntheticExamples
from fitone.errors import DataError
from fitone.models import CAUSAL, SEQ2SEQ


def collate(examples: Sequence[Example], task: str, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest example in the batch (dynamic padding); label padding is ignored by the loss.

    Packed rows (full, with position ids) go without an attention mask: transformers then reads the
    examples' boundaries from the position ids."""
    if examples[0].position_ids is not None:
        return {"input_ids": torch.tensor([e.input_ids for e in examples], dtype=torch.long),
                "labels": torch.tensor([e.labels for e in examples], dtype=torch.long),
                "position_ids": torch.tensor([e.position_ids for e in examples], dtype=torch.long)}
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, : len(e.input_ids)] = 1
    if task == CAUSAL:  # labels line up with the inputs (the model shifts them); a prompt's are ignored
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for i, e in enumerate(examples):
            labels[i, : len(e.labels)] = torch.tensor(e.labels)
    else:
        lw = max(len(e.labels) for e in examples)
        labels = torch.full((len(examples), lw), IGNORE_INDEX, dtype=torch.long)
        for i, e in enumerate(examples):
            labels[i, : len(e.labels)] = torch.tensor(e.labels)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_tokens(batch: dict[str, torch.Tensor], task: str) -> int:
    """Tokens the loss is taken on: padding, prompts and (causal) each row's first token excluded, so
    packed and unpacked batches of the same examples count the same."""
    labels = batch["labels"][:, 1:] if task == CAUSAL else batch["labels"]
    return int((labels != IGNORE_INDEX).sum())


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919 * epoch)).tolist()


def batches(data: Dataset, micro_batch: int, *, seed: int, pad_id: int, rank: int = 0, world_size: int = 1,
            start_epoch: int = 0, start_batch: int = 0) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Endless (epoch, batch_index, batch) over shuffled epochs; each rank takes its own slice.

    Resuming at (start_epoch, start_batch) yields exactly the batches an uninterrupted run would.
    Incomplete last batches are dropped so every step has the same shape.
    """
    require_one_batch(data, micro_batch, world_size)
    per_step = micro_batch * world_size
    n_batches = len(data) // per_step
    epoch, b = start_epoch, start_batch
    while True:
        if data.source == "synthetic":  # random already; skip the 1M-element permutation
            order = range(epoch * n_batches * per_step, (epoch + 1) * n_batches * per_step)
        else:
            order = epoch_order(len(data), seed, epoch)
        while b < n_batches:
            idx = order[b * per_step + rank * micro_batch: b * per_step + (rank + 1) * micro_batch]
            yield epoch, b, collate([data.examples[i % len(data)] for i in idx], data.task, pad_id)
            b += 1
        epoch, b = epoch + 1, 0


def require_one_batch(data: Dataset, micro_batch: int, world_size: int = 1) -> None:
    """Fail before training when the data cannot fill one micro-batch on every GPU."""
    per_step = micro_batch * world_size
    if len(data) < per_step:
        raise DataError(f"{data.source or 'the data'} has {len(data)} examples, fewer than one step's "
                        f"{per_step} (micro-batch x GPUs): lower --batch-size or add data")


def resume_position(epoch: int, batch: int, was_per_step: int, now_per_step: int) -> tuple[int, int]:
    """The (epoch, batch) that starts at the same example after the examples per micro-step changed
    (a lower --batch-size on resume). Rounds down: at most one micro-batch of examples is seen twice."""
    return epoch, (batch * was_per_step) // now_per_step


def steps_per_epoch(data: Dataset, micro_batch: int, world_size: int, accum: int) -> int:
    return max(1, len(data) // (micro_batch * world_size) // accum)


def worst_case_batch(task: str, micro_batch: int, settings: DataSettings, vocab_size: int, pad_id: int,
                     data: Dataset | None = None) -> dict[str, torch.Tensor]:
    """A batch at the worst-case lengths: with data, its longest examples; else every sequence at the maximum.

    A size that fits short batches can OOM an hour later on long ones, so the probe measures this one.
    With --pack every batch is full: rows of --seq-len tokens holding several examples, as training sees them.
    """
    if settings.pack and task == CAUSAL:
        rows = [_packed_row(vocab_size, settings.seq_len, settings.seed + k) for k in range(micro_batch)]
        return collate(rows, task, pad_id)
    if data is not None and data.source != "synthetic":
        sizes = example_lengths(data)
        longest = sorted(range(len(data)), key=sizes.__getitem__)
        pick = [data.examples[longest[-1 - (k % len(longest))]] for k in range(micro_batch)]
        return collate(pick, task, pad_id)
    src = settings.seq_len if task == CAUSAL else settings.src_len
    synth = SyntheticExamples(task, vocab_size, src, settings.tgt_len, settings.seed)
    return collate([synth[k] for k in range(micro_batch)], task, pad_id)


def example_lengths(data: Dataset) -> Sequence[int]:
    if isinstance(data.examples, ArrowExamples):
        return data.examples.lengths()
    return [len(e.input_ids) + (len(e.labels) if data.task == SEQ2SEQ else 0) for e in data.examples]


def _packed_row(vocab_size: int, seq_len: int, seed: int) -> Example:
    """A full packed row of random tokens: examples of a quarter of the row each, so the attention runs the
    packed path (a block-diagonal mask) that training's rows take."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (seq_len,), generator=g).tolist()
    part = max(1, seq_len // 4)
    pos = [i % part for i in range(seq_len)]
    return Example(ids, [IGNORE_INDEX if p == 0 else t for p, t in zip(pos, ids)], pos)
