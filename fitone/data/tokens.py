"""Rows -> tokenised examples, as the model's tokenizer tokenises text (its own BOS and EOS), truncated to the
configured lengths and, with --pack, packed into full rows. Tokenised rows stay in memory-mapped Arrow files
(datasets' cache), read one example at a time."""

from __future__ import annotations

from typing import Any

from fitone.config import DataSettings
from fitone.data.chat import chat_tokenizer, render_chat
from fitone.data.examples import IGNORE_INDEX, ArrowExamples, Dataset, Example
from fitone.data.sources import ChatFields, Rows, datasets_output, open_data
from fitone.data.synthetic import SyntheticExamples
from fitone.models import CAUSAL, SEQ2SEQ

# part of the tokenised rows' cache key: a new value whenever the same rows and tokenizer give other tokens
# (2: the tokenizer's own BOS is kept, issue 26), so rows cached by older code are tokenised again
TOKENS_FORMAT = 2
_PROBE = "a"  # a text that any tokenizer splits into ordinary tokens


def load_dataset(settings: DataSettings, task: str, tokenizer, vocab_size: int, *, split: str = "train",
                 rows: Rows | None = None) -> Dataset | None:
    """The run's train (or eval) examples, tokenised (cached by datasets), truncated to the configured
    lengths, and for training with --pack packed into full rows.

    `rows` are the source's rows when the caller has already opened (and so checked) them.
    """
    if settings.data == "synthetic" and split == "train":
        src = settings.seq_len if task == CAUSAL else settings.src_len
        examples = SyntheticExamples(task, vocab_size, src, settings.tgt_len, settings.seed)
        return Dataset(task, examples, source="synthetic")
    if rows is None:
        rows = open_data(settings, task, split=split)
        if rows is None:
            return None
    return tokenize(rows, task, tokenizer, settings, pack=settings.pack and split == "train")


def tokenize(rows: Rows, task: str, tokenizer, settings: DataSettings, *, pack: bool = False) -> Dataset:
    """Tokenise every row with datasets' map (a progress bar; cached between runs unless --no-cache).

    Text is tokenised as the model's tokenizer tokenises it: its own special tokens around each text (the BOS
    a pretrained model always saw), and EOS at the end of what is learnt where the tokenizer adds none itself.
    A prompt takes the tokenizer's start, its text the end: one BOS, at the very start."""
    if isinstance(rows.fields, ChatFields):
        chat_tokenizer(tokenizer, settings.chat_template, rows.source)
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
            src_len, tgt_len = settings.src_len, settings.tgt_len
            for s, t in zip(srcs, tgts):
                add(Example(_clip(before, s, after, src_len), _clip(before, t, end, tgt_len)),
                    len(before) + len(s) + len(after) > src_len or len(before) + len(t) + len(end) > tgt_len)
        elif isinstance(fields, ChatFields):
            for messages in batch[fields[0]]:  # the chat template places BOS and end-of-turn tokens itself
                ids, labels = render_chat(messages, tokenizer)
                ids, labels, cut = ids[: settings.seq_len], labels[: settings.seq_len], len(ids) > settings.seq_len
                if any(y != IGNORE_INDEX for y in labels[1:]):  # else nothing to learn: left out (see `dropped`)
                    add(Example(ids, labels), cut)
        else:
            texts = tokenizer(batch[fields[-1]], add_special_tokens=False)["input_ids"]
            prompts = tokenizer(batch[fields[0]], add_special_tokens=False)["input_ids"] \
                if len(fields) == 2 else [[] for _ in texts]
            for prompt, text in zip(prompts, texts):
                add(*_causal_example(before, list(prompt), list(text) + end, settings.seq_len))
        return out

    lengths = (settings.src_len, settings.tgt_len) if task == SEQ2SEQ else (settings.seq_len,)
    with datasets_output(bars=settings.progress, logs=settings.verbose):
        table = rows.table.select_columns(list(fields)).map(  # other columns are never read
            encode, batched=True, remove_columns=list(fields), desc="tokenising",
            load_from_cache_file=settings.cache,
            new_fingerprint=_fingerprint(rows.table, tokenizer, "tokenise", TOKENS_FORMAT, task, tuple(fields),
                                         lengths, type(fields).__name__))
        truncated = sum(table["truncated"]) if len(table) else 0
        dropped = len(rows.table) - len(table)
        packed_from = None
        if pack:
            packed_from = len(table)
            table = pack_examples(table, settings.seq_len, tokenizer.pad_token_id, use_cache=settings.cache)
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
