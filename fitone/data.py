"""Datasets -> padded (or packed) batches, for seq2seq and causal LMs, plus the worst-case batch the probe uses.

Sources: a file, glob, save_to_disk directory or hub id opened by fitone.datasets_io (seq2seq:
source/target fields; causal: text, prompt + text, or chat `messages`), `sample` (the shipped
numbers-to-words task) or `synthetic` (random tokens at the maximum lengths, for benchmarks).
Tokenised rows stay in memory-mapped Arrow files (datasets' cache), read one batch at a time.
Order is a seeded permutation per epoch, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitone.config import TrainConfig
from fitone.errors import ConfigError, DataError
from fitone.models import CAUSAL, SEQ2SEQ

SAMPLE_DIR = Path(__file__).parent / "sample_data"
SAMPLE_TRAIN = SAMPLE_DIR / "numbers-train.jsonl"
SAMPLE_EVAL = SAMPLE_DIR / "numbers-eval.jsonl"
IGNORE_INDEX = -100  # label positions the loss skips (padding)
SYNTHETIC_SIZE = 1 << 20  # examples; generated on demand from the seed
# part of the tokenised rows' cache key: a new value whenever the same rows and tokenizer give other tokens
# (2: the tokenizer's own BOS is kept, issue 26), so rows cached by older code are tokenised again
TOKENS_FORMAT = 2
_PROBE = "a"  # a text that any tokenizer splits into ordinary tokens


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


class CausalFields(tuple):
    """(prompt field, text field) of a causal LM's rows: the loss is taken on the text only."""


class ChatFields(tuple):
    """(messages field,): rows are chat conversations; the loss is taken on the assistant turns only."""


MESSAGES_FIELD = "messages"


def _field_flags(fields: Sequence[str]) -> dict[str, str]:
    """field -> the option that renames it, for error messages."""
    if isinstance(fields, ChatFields):
        return {fields[0]: "text-field"}
    if isinstance(fields, CausalFields):
        return {fields[0]: "prompt-field", fields[1]: "text-field"}
    if len(fields) == 1:
        return {fields[0]: "text-field"}
    return {fields[0]: "source-field", fields[1]: "target-field"}


def _user_fields(cfg: TrainConfig, task: str) -> tuple[str, ...]:
    if task == SEQ2SEQ:
        if cfg.prompt_field:
            raise ConfigError(f"--prompt-field is for causal LMs; {cfg.model} is seq2seq: its input is "
                              "--source-field and its output --target-field")
        if cfg.pack:
            raise ConfigError(f"--pack is for causal LMs; {cfg.model} is seq2seq: drop --pack (its batches are "
                              "padded to their longest example)")
        return (cfg.source_field, cfg.target_field)
    return CausalFields((cfg.prompt_field, cfg.text_field)) if cfg.prompt_field else (cfg.text_field,)


def data_file(cfg: TrainConfig, task: str, *, split: str = "train") -> tuple[str, tuple[str, ...]] | None:
    """The source (file, glob, save_to_disk dir or hub id) and text fields a run reads for `split`; None when
    there is none (synthetic data, or no --eval-data beside a user's data: fitone does not hold out silently)."""
    user_fields = _user_fields(cfg, task)
    if split == "eval" and cfg.eval_data:
        return cfg.eval_data, user_fields
    if cfg.data == "synthetic":
        return None
    if cfg.data == "sample":
        if task != SEQ2SEQ:
            raise ConfigError("the sample task is seq2seq (numbers to words): use a T5 model, or --data FILE.jsonl "
                              "with a 'text' field for a causal LM")
        return str(SAMPLE_EVAL if split == "eval" else SAMPLE_TRAIN), ("source", "target")
    if split == "eval":
        return None
    return cfg.data, user_fields


@dataclass
class Rows:
    """A source's rows, opened and checked (memory-mapped, not read), and the fields a run takes from them."""

    table: Any  # datasets.Dataset
    fields: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            part = self.table[i]
            return [dict(zip(part, values)) for values in zip(*part.values())]
        return self.table[int(i)]


def open_data(cfg: TrainConfig, task: str, *, split: str = "train") -> Rows | None:
    """Open the train (or eval) source and check its fields, before any weights load; None where data_file
    has none. Causal rows with a `messages` list and no text field are chat conversations."""
    from fitone.datasets_io import check_fields, open_rows

    found = data_file(cfg, task, split=split)
    if found is None:
        return None
    spec, fields = found
    user_eval = split == "eval" and bool(cfg.eval_data)
    flag = "--eval-data" if user_eval else "--data"
    table = open_rows(spec, flag=flag, split=(cfg.eval_split if user_eval else cfg.data_split),
                      config_name=cfg.data_config, text_fields=fields, use_cache=cfg.cache, verbose=cfg.verbose)
    if task == CAUSAL and not cfg.prompt_field and cfg.text_field not in table.column_names \
            and MESSAGES_FIELD in table.column_names:
        fields = ChatFields((MESSAGES_FIELD,))
        check_chat(table, spec)
    else:
        check_fields(table, fields, flag=flag, name=spec, flag_of=_field_flags(fields))
    return Rows(table, fields, spec)


def load_dataset(cfg: TrainConfig, task: str, tokenizer, vocab_size: int, *, split: str = "train",
                 rows: Rows | None = None) -> Dataset | None:
    """The run's train (or eval) examples, tokenised (cached by datasets), truncated to the configured
    lengths, and for training with --pack packed into full rows.

    `rows` are the source's rows when the caller has already opened (and so checked) them.
    """
    if cfg.data == "synthetic" and split == "train":
        src = cfg.seq_len if task == CAUSAL else cfg.src_len
        return Dataset(task, SyntheticExamples(task, vocab_size, src, cfg.tgt_len, cfg.seed), source="synthetic")
    if rows is None:
        rows = open_data(cfg, task, split=split)
        if rows is None:
            return None
    return tokenize(rows, task, tokenizer, cfg, pack=cfg.pack and split == "train")


def tokenize(rows: Rows, task: str, tokenizer, cfg: TrainConfig, *, pack: bool = False) -> Dataset:
    """Tokenise every row with datasets' map (a progress bar; cached between runs unless --no-cache).

    Text is tokenised as the model's tokenizer tokenises it: its own special tokens around each text (the BOS
    a pretrained model always saw), and EOS at the end of what is learnt where the tokenizer adds none itself.
    A prompt takes the tokenizer's start, its text the end: one BOS, at the very start."""
    from fitone.datasets_io import datasets_output

    if isinstance(rows.fields, ChatFields):
        chat_tokenizer(tokenizer, cfg.chat_template, rows.source)
    before, after = special_tokens(tokenizer)
    eos = tokenizer.eos_token_id
    end = after if eos is None or eos in after else after + [eos]  # so the model learns to stop
    fields = rows.fields

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": []}

        def add(example: Example, cut: bool) -> None:
            out["input_ids"].append(example.input_ids)
            out["labels"].append(example.labels)
            out["length"].append(len(example.input_ids) + (len(example.labels) if task == SEQ2SEQ else 0))
            out["truncated"].append(cut)

        if task == SEQ2SEQ:
            srcs = tokenizer(batch[fields[0]], add_special_tokens=False)["input_ids"]
            tgts = tokenizer(batch[fields[1]], add_special_tokens=False)["input_ids"]
            for s, t in zip(srcs, tgts):
                add(Example(_clip(before, s, after, cfg.src_len), _clip(before, t, end, cfg.tgt_len)),
                    len(before) + len(s) + len(after) > cfg.src_len or len(before) + len(t) + len(end) > cfg.tgt_len)
        elif isinstance(fields, ChatFields):
            for messages in batch[fields[0]]:  # the chat template places BOS and end-of-turn tokens itself
                ids, labels = render_chat(messages, tokenizer)
                ids, labels, cut = ids[: cfg.seq_len], labels[: cfg.seq_len], len(ids) > cfg.seq_len
                if any(y != IGNORE_INDEX for y in labels[1:]):  # else nothing to learn: left out (see `dropped`)
                    add(Example(ids, labels), cut)
        else:
            texts = tokenizer(batch[fields[-1]], add_special_tokens=False)["input_ids"]
            prompts = tokenizer(batch[fields[0]], add_special_tokens=False)["input_ids"] \
                if len(fields) == 2 else [[] for _ in texts]
            for prompt, text in zip(prompts, texts):
                add(*_causal_example(before, list(prompt), list(text) + end, cfg.seq_len))
        return out

    lengths = (cfg.src_len, cfg.tgt_len) if task == SEQ2SEQ else (cfg.seq_len,)
    with datasets_output(bars=cfg.progress, logs=cfg.verbose):
        table = rows.table.select_columns(list(fields)).map(  # other columns are never read
            encode, batched=True, remove_columns=list(fields), desc="tokenising",
            load_from_cache_file=cfg.cache,
            new_fingerprint=_fingerprint(rows.table, tokenizer, "tokenise", TOKENS_FORMAT, task, tuple(fields),
                                         lengths, type(fields).__name__))
        truncated = sum(table["truncated"]) if len(table) else 0
        dropped = len(rows.table) - len(table)
        packed_from = None
        if pack:
            packed_from = len(table)
            table = pack_examples(table, cfg.seq_len, tokenizer.pad_token_id, use_cache=cfg.cache)
    return Dataset(task, ArrowExamples(table), truncated=truncated, source=rows.source, raw=rows,
                   dropped=dropped, packed_from=packed_from)


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after any text of its own accord (BOS; T5's EOS), read off a
    probe text tokenised with and without them."""
    bare = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(_PROBE, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i: i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    # the specials change how the text itself is split: keep the BOS and EOS they add
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None and full[:1] == [bos] != bare[:1] else [],
            [eos] if eos is not None and full[-1:] == [eos] != bare[-1:] else [])


def _fingerprint(table, tokenizer, *parts: Any) -> str:
    """A map's cache key: the input table's, the tokenizer's (vocabulary and chat template) and the options.
    Explicit, because hashing the closure can fall back to a random hash and never hit the cache."""
    from datasets.fingerprint import Hasher

    return Hasher.hash([table._fingerprint, Hasher.hash(tokenizer), getattr(tokenizer, "chat_template", None),
                        *parts])


def chat_tokenizer(tokenizer, template_file: str | None, source: str) -> None:
    """Give the tokenizer --chat-template's template (exported with it in final/); refuse chat data without one."""
    if template_file:
        tokenizer.chat_template = Path(template_file).read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source} holds chat '{MESSAGES_FIELD}' rows but the model's tokenizer has no chat template: "
                        "give one with --chat-template FILE.jinja")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_chat(table, source: str) -> None:
    """Every conversation is a list of {role, content} messages with text values and a known role; the first
    row that is not is named (a misspelled 'assistant' would otherwise train on nothing)."""
    for i, messages in _suspect_conversations(table):
        problem = _conversation_problem(messages)
        if problem:
            raise DataError(f"{source}: example {i + 1}: {problem}")


def _suspect_conversations(table) -> Iterator[tuple[int, Any]]:
    """(row, conversation) of the rows that may be wrong. Where every message has the same text fields, Arrow
    finds the first such row column by column and only it is read; other shapes (datasets' Json type, for
    messages with different keys) are read row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.data.column(MESSAGES_FIELD)
    item = getattr(column.type, "value_type", None)
    if not (item is not None and pa.types.is_struct(item) and all(
            item.get_field_index(key) >= 0 and item.field(key).type in (pa.string(), pa.large_string())
            for key in ("role", "content"))):
        for start, batch in enumerate(table.select_columns([MESSAGES_FIELD]).iter(batch_size=1000)):
            yield from enumerate(batch[MESSAGES_FIELD], start * 1000)
        return
    start = 0
    for chunk in column.chunks:
        messages = pc.list_flatten(chunk)
        roles = pc.struct_field(messages, "role")
        bad = pc.or_(pc.or_(pc.is_null(roles), pc.is_null(pc.struct_field(messages, "content"))),
                     pc.invert(pc.fill_null(pc.is_in(roles, value_set=pa.array(CHAT_ROLES)), True)))
        at = pc.index(bad, True).as_py()
        rows = [r for r in (pc.index(pc.is_null(chunk), True).as_py(),
                            pc.list_parent_indices(chunk)[at].as_py() if at >= 0 else -1) if r >= 0]
        if rows:
            yield start + min(rows), chunk[min(rows)].as_py()
        start += len(chunk)


def _conversation_problem(messages: Any) -> str | None:
    shape = f"'{MESSAGES_FIELD}' must be a list of {{role, content}} objects with text values"
    if not isinstance(messages, list):
        return f"{shape}; got {str(messages)[:60]}"
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"{shape}; got {str(m)[:60]}"
        if m["role"] not in CHAT_ROLES:
            near = difflib.get_close_matches(m["role"], CHAT_ROLES, n=1)
            return (f"unknown chat role {m['role']!r} (" + (f"did you mean {near[0]!r}? " if near else "")
                    + f"the roles are {', '.join(CHAT_ROLES)}): fix the row's role")
    return None


def render_chat(messages: list[dict[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """input_ids of the conversation (checked by check_chat) rendered by the chat template, and labels that
    are those ids inside the assistant turns and IGNORE_INDEX elsewhere.

    An assistant turn's text is what rendering messages[:k+1] adds to messages[:k] with the generation
    prompt (so its end-of-turn marker is learnt, the role header is not). The rendered text is tokenised
    piece by piece at those boundaries, which chat templates mark with special tokens."""
    def render(part: list[dict[str, str]], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    full, pieces, at = render(messages), [], 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:k], prompt=True), render(messages[: k + 1])
        if not (full.startswith(through) and through.startswith(before) and len(before) >= at):
            raise DataError("the chat template renders earlier turns differently once later turns follow, so the "
                            "assistant turns cannot be found: give a --chat-template FILE that renders each turn "
                            "the same way wherever it stands")
        pieces += [(full[at:len(before)], False), (full[len(before):len(through)], True)]
        at = len(through)
    pieces.append((full[at:], False))
    ids: list[int] = []
    labels: list[int] = []
    for text, learn in pieces:
        if text:
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += part
            labels += part if learn else [IGNORE_INDEX] * len(part)
    return ids, labels


def pack_examples(table, seq_len: int, pad_id: int, *, use_cache: bool = True):
    """Whole examples concatenated, in order, into rows of exactly seq_len tokens.

    Each example's position ids restart at 0, which is how transformers finds the examples of a row
    (a block-diagonal mask, on the models fitone.packing lists): no token attends to another
    example's. Each example's first label is ignored, as the unpacked loss never predicts a first
    token. The rest of a row, shorter than the next example, is padding: its own block, no labels."""
    def pack(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "length": [], "truncated": []}
        row: tuple[list[int], list[int], list[int]] = ([], [], [])

        def flush() -> None:
            ids, labels, pos = row
            fill = seq_len - len(ids)
            out["input_ids"].append(ids + [pad_id] * fill)
            out["labels"].append(labels + [IGNORE_INDEX] * fill)
            out["position_ids"].append(pos + list(range(fill)))
            out["length"].append(seq_len)
            out["truncated"].append(False)

        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            if row[0] and len(row[0]) + len(ids) > seq_len:
                flush()
                row = ([], [], [])
            row[0].extend(ids)
            row[1].extend([IGNORE_INDEX] + list(labels[1:]))
            row[2].extend(range(len(ids)))
        if row[0]:
            flush()
        return out

    return table.map(pack, batched=True, batch_size=1000, remove_columns=table.column_names, desc="packing",
                     load_from_cache_file=use_cache, new_fingerprint=_fingerprint(table, None, "pack", seq_len, pad_id))


def _causal_example(before: list[int], prompt: list[int], text: list[int], limit: int) -> tuple[Example, bool]:
    """before (the tokenizer's BOS) + prompt + text within `limit` tokens, the loss on the text only (BOS and
    prompt labels are IGNORE_INDEX).

    Too long: the BOS stays first, the text keeps its first tokens (at most all but one of the room left when
    there is a prompt) and the prompt its last ones, next to the text, so every example keeps something to
    learn from. Returns (example, whether it was cut)."""
    before = before[: max(0, limit - 1)]  # a text token always fits
    room = limit - len(before)
    cut = len(prompt) + len(text) > room
    if cut:
        text = text[: max(1, room - 1)] if prompt else text[:room]
        prompt = prompt[len(prompt) - (room - len(text)):] if room > len(text) else []
    return Example(before + prompt + text, [IGNORE_INDEX] * (len(before) + len(prompt)) + text), cut


def _clip(before: list[int], ids: list[int], after: list[int], limit: int) -> list[int]:
    """before + ids + after within `limit`: too long, the text is cut, keeping the tokenizer's start (BOS) and
    its end (EOS), so the model still learns to stop."""
    if len(before) + len(ids) + len(after) <= limit:
        return before + ids + after
    ends = before + after
    if len(ends) >= limit:  # no room for text: keep the end token
        return ends[-limit:]
    return before + ids[: limit - len(ends)] + after


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


def worst_case_batch(task: str, micro_batch: int, cfg: TrainConfig, vocab_size: int, pad_id: int,
                     data: Dataset | None = None) -> dict[str, torch.Tensor]:
    """A batch at the worst-case lengths: with data, its longest examples; else every sequence at the maximum.

    A size that fits short batches can OOM an hour later on long ones, so the probe measures this one.
    With --pack every batch is full: rows of --seq-len tokens holding several examples, as training sees them.
    """
    if cfg.pack and task == CAUSAL:
        return collate([_packed_row(vocab_size, cfg.seq_len, cfg.seed + k) for k in range(micro_batch)], task, pad_id)
    if data is not None and data.source != "synthetic":
        sizes = example_lengths(data)
        longest = sorted(range(len(data)), key=sizes.__getitem__)
        pick = [data.examples[longest[-1 - (k % len(longest))]] for k in range(micro_batch)]
        return collate(pick, task, pad_id)
    src = cfg.seq_len if task == CAUSAL else cfg.src_len
    synth = SyntheticExamples(task, vocab_size, src, cfg.tgt_len, cfg.seed)
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
