"""Datasets -> padded batches, for seq2seq and causal LMs, plus the worst-case batch the probe uses.

Sources: a JSONL file (seq2seq: source/target fields, causal: text), `sample` (the shipped
numbers-to-words task) or `synthetic` (random tokens at the maximum lengths, for benchmarks).
Order is a seeded permutation per epoch, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from fitone.config import TrainConfig
from fitone.errors import ConfigError, DataError
from fitone.models import CAUSAL, SEQ2SEQ

SAMPLE_DIR = Path(__file__).parent / "sample_data"
SAMPLE_TRAIN = SAMPLE_DIR / "numbers-train.jsonl"
SAMPLE_EVAL = SAMPLE_DIR / "numbers-eval.jsonl"
IGNORE_INDEX = -100  # label positions the loss skips (padding)
SYNTHETIC_SIZE = 1 << 20  # examples; generated on demand from the seed


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class Dataset:
    """Tokenised examples (or a synthetic generator), with what was truncated while reading."""

    task: str
    examples: Sequence[Example]
    truncated: int = 0
    source: str = ""
    raw: list[dict[str, Any]] = field(default_factory=list, repr=False)  # text, for scoring generations

    def __len__(self) -> int:
        return len(self.examples)


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


def read_jsonl(path: Path, fields: Sequence[str], *, flag: str = "--data") -> list[dict[str, str]]:
    """Rows of a JSONL file, each checked to hold the given text fields (as `data_file` names them: seq2seq
    source and target, causal text, or causal prompt and text). Errors name the file and line."""
    if not path.exists():
        choices = ", 'sample' or 'synthetic'" if flag == "--data" else ""
        raise DataError(f"{flag} file {path} does not exist: give a JSONL path{choices}")
    if path.is_dir():
        raise DataError(f"{flag} path {path} is a directory: give a JSONL file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DataError(f"cannot read {flag} file {path}: {exc.strerror}; check its permissions") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"{flag} file {path} is not UTF-8 text; convert it to UTF-8 JSONL") from exc
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object with fields {', '.join(fields)}")
        for name in fields:
            if name not in row:
                raise DataError(f"{path}:{lineno}: missing field {name!r}; rename the field or pass "
                                f"--{_field_flag(name, fields)} with the name your file uses")
            if not isinstance(row[name], str):
                raise DataError(f"{path}:{lineno}: field {name!r} must be text, got {type(row[name]).__name__}")
        rows.append({name: row[name] for name in fields})
    if not rows:
        raise DataError(f"{flag} file {path} holds no examples; add JSON lines with fields {', '.join(fields)}")
    return rows


class CausalFields(tuple):
    """(prompt field, text field) of a causal LM's rows: the loss is taken on the text only."""


def _field_flag(name: str, fields: Sequence[str]) -> str:
    if isinstance(fields, CausalFields):
        return "prompt-field" if name == fields[0] else "text-field"
    if len(fields) == 1:
        return "text-field"
    return "source-field" if name == fields[0] else "target-field"


def _user_fields(cfg: TrainConfig, task: str) -> tuple[str, ...]:
    if task == SEQ2SEQ:
        if cfg.prompt_field:
            raise ConfigError(f"--prompt-field is for causal LMs; {cfg.model} is seq2seq: its input is "
                              "--source-field and its output --target-field")
        return (cfg.source_field, cfg.target_field)
    return CausalFields((cfg.prompt_field, cfg.text_field)) if cfg.prompt_field else (cfg.text_field,)


def data_file(cfg: TrainConfig, task: str, *, split: str = "train") -> tuple[Path, tuple[str, ...]] | None:
    """The JSONL file and text fields a run reads for `split`; None when there is none (synthetic data,
    or no --eval-data beside a user's file: fitone does not hold out silently)."""
    user_fields = _user_fields(cfg, task)
    if split == "eval" and cfg.eval_data:
        return Path(cfg.eval_data), user_fields
    if cfg.data == "synthetic":
        return None
    if cfg.data == "sample":
        if task != SEQ2SEQ:
            raise ConfigError("the sample task is seq2seq (numbers to words): use a T5 model, or --data FILE.jsonl "
                              "with a 'text' field for a causal LM")
        return (SAMPLE_EVAL if split == "eval" else SAMPLE_TRAIN), ("source", "target")
    if split == "eval":
        return None
    return Path(cfg.data), user_fields


def load_dataset(cfg: TrainConfig, task: str, tokenizer, vocab_size: int, *, split: str = "train",
                 rows: list[dict[str, str]] | None = None) -> Dataset | None:
    """The run's train (or eval) examples, tokenised and truncated to the configured lengths.

    `rows` are the file's rows when the caller has already read (and so checked) them.
    """
    if cfg.data == "synthetic" and split == "train":
        src = cfg.seq_len if task == CAUSAL else cfg.src_len
        return Dataset(task, SyntheticExamples(task, vocab_size, src, cfg.tgt_len, cfg.seed), source="synthetic")
    found = data_file(cfg, task, split=split)
    if found is None:
        return None
    path, fields = found
    if rows is None:
        rows = read_jsonl(path, fields, flag="--eval-data" if split == "eval" and cfg.eval_data else "--data")
    return tokenize(rows, fields, task, tokenizer, cfg, source=str(path))


def tokenize(rows: list[dict[str, str]], fields: Sequence[str], task: str, tokenizer, cfg: TrainConfig,
             source: str = "") -> Dataset:
    eos = tokenizer.eos_token_id
    examples, truncated = [], 0
    if task == SEQ2SEQ:
        srcs = tokenizer([r[fields[0]] for r in rows], add_special_tokens=True)["input_ids"]
        tgts = tokenizer([r[fields[1]] for r in rows], add_special_tokens=True)["input_ids"]
        for s, t in zip(srcs, tgts):
            if len(s) > cfg.src_len or len(t) > cfg.tgt_len:
                truncated += 1
            examples.append(Example(_clip(s, cfg.src_len, eos), _clip(t, cfg.tgt_len, eos)))
    else:
        texts = tokenizer([r[fields[-1]] for r in rows], add_special_tokens=False)["input_ids"]
        prompts = tokenizer([r[fields[0]] for r in rows], add_special_tokens=False)["input_ids"] \
            if len(fields) == 2 else [[] for _ in rows]
        for prompt, text in zip(prompts, texts):
            example, cut = _causal_example(list(prompt), list(text) + ([eos] if eos is not None else []), cfg.seq_len)
            truncated += cut
            examples.append(example)
    return Dataset(task, examples, truncated=truncated, source=source, raw=rows)


def _causal_example(prompt: list[int], text: list[int], limit: int) -> tuple[Example, bool]:
    """prompt + text within `limit` tokens, the loss on the text only (prompt labels are IGNORE_INDEX).

    Too long: the text keeps its first tokens (at most limit - 1 when there is a prompt) and the prompt
    its last ones, next to the text, so every example keeps something to learn from. Returns (example,
    whether it was cut)."""
    cut = len(prompt) + len(text) > limit
    if cut:
        text = text[: max(1, limit - 1)] if prompt else text[:limit]
        prompt = prompt[len(prompt) - (limit - len(text)):] if limit > len(text) else []
    return Example(prompt + text, [IGNORE_INDEX] * len(prompt) + text), cut


def _clip(ids: list[int], limit: int, eos: int | None) -> list[int]:
    """Truncate to `limit`, keeping the end-of-sequence token last so the model still learns to stop."""
    if len(ids) <= limit:
        return list(ids)
    return list(ids[: limit - 1]) + [eos] if eos is not None else list(ids[:limit])


def collate(examples: Sequence[Example], task: str, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest example in the batch (dynamic padding); label padding is ignored by the loss."""
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


def worst_case_batch(task: str, micro_batch: int, cfg: TrainConfig, vocab_size: int, pad_id: int,
                     data: Dataset | None = None) -> dict[str, torch.Tensor]:
    """A batch at the worst-case lengths: with data, its longest examples; else every sequence at the maximum.

    A size that fits short batches can OOM an hour later on long ones, so the probe measures this one.
    """
    if data is not None and data.source != "synthetic":
        longest = sorted(range(len(data)), key=lambda i: len(data.examples[i].input_ids) + len(data.examples[i].labels))
        pick = [data.examples[longest[-1 - (k % len(longest))]] for k in range(micro_batch)]
        return collate(pick, task, pad_id)
    src = cfg.seq_len if task == CAUSAL else cfg.src_len
    synth = SyntheticExamples(task, vocab_size, src, cfg.tgt_len, cfg.seed)
    return collate([synth[k] for k in range(micro_batch)], task, pad_id)
