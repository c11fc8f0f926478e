"""--data through the datasets library: file formats, save_to_disk, hub ids, chat messages, packing, memory.

Every source is converted by datasets into its cache; each test points HF_DATASETS_CACHE at its own
temporary folder, so no test reads another's cache.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import child_env, run_main
from transformers import ByT5Tokenizer

from fitone.config import DataSettings, TrainConfig
from fitone.data import IGNORE_INDEX, batches, collate, load_dataset, open_data, worst_case_batch
from fitone.data.tokens import pack_examples
from fitone.errors import ConfigError, DataError
from fitone.models import CAUSAL, SEQ2SEQ

TOK = ByT5Tokenizer()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def _cfg(**kw) -> DataSettings:
    return TrainConfig(**{"model": "t5-tiny", "progress": False, **kw}).data_settings()


def _rows(n: int = 40) -> list[dict[str, str]]:
    # digits-only sources: a CSV reader would make them numbers ('007' -> 7) unless read as text
    return [{"source": f"{i:03d}", "target": "x" * (1 + i % 7)} for i in range(n)]


def _write_all_formats(tmp_path, rows) -> dict[str, str]:
    import datasets
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    half = len(rows) // 2
    pd.DataFrame(rows[:half]).to_parquet(tmp_path / "shard-0.parquet")
    pd.DataFrame(rows[half:]).to_parquet(tmp_path / "shard-1.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    return {"jsonl": str(tmp_path / "d.jsonl"), "csv": str(tmp_path / "d.csv"),
            "parquet": str(tmp_path / "d.parquet"), "glob": str(tmp_path / "shard-*.parquet"),
            "save_to_disk": str(tmp_path / "saved")}


def test_jsonl_csv_parquet_glob_and_save_to_disk_give_identical_batches(tmp_path):
    sources = _write_all_formats(tmp_path, _rows())
    seen = {}
    for kind, spec in sources.items():
        data = load_dataset(_cfg(data=spec), SEQ2SEQ, TOK, 384)
        stream = batches(data, 4, seed=3, pad_id=0)
        seen[kind] = [next(stream)[2] for _ in range(12)]  # past the first epoch (10 batches)
    want = seen.pop("jsonl")
    for kind, got in seen.items():
        for a, b in zip(want, got):
            assert a.keys() == b.keys()
            assert all(a[k].equal(b[k]) for k in a), kind
    # and the CSV kept '007' as text (a number would have lost its zeros and failed the comparison above)
    assert open_data(_cfg(data=sources["csv"]), SEQ2SEQ).table[7]["source"] == "007"


def test_a_missing_field_names_the_fields_the_data_has(tmp_path):
    sources = _write_all_formats(tmp_path, _rows(4))
    for spec in sources.values():
        with pytest.raises(DataError, match=r"has no field 'question' \(its fields: source, target\).*"
                                            r"--source-field"):
            open_data(_cfg(data=spec, source_field="question"), SEQ2SEQ)


def test_sources_that_cannot_be_opened_are_one_line_each(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "notes.txt").write_text("hi\n")
    cases = [
        (str(tmp_path / "none-*.parquet"), "matches no files"),
        (str(tmp_path / "plain"), "is a directory: give a JSONL file .* save_to_disk"),
        (str(tmp_path / "notes.txt"), r"give .jsonl/.json, .csv or .parquet files"),
        ("someone/no-such-dataset", r"no such file, and the hub dataset cannot be loaded \(offline and not in "
                                    r"the local cache\)"),
    ]
    for spec, pattern in cases:
        with pytest.raises(DataError, match=pattern) as caught:
            open_data(_cfg(data=spec), SEQ2SEQ)
        assert "\n" not in str(caught.value)


def test_a_datasetdict_on_disk_is_read_by_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(8)),
                               "test": datasets.Dataset.from_list(_rows(3))})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(open_data(_cfg(data=str(tmp_path / "dd")), SEQ2SEQ)) == 8
    assert len(open_data(_cfg(data=str(tmp_path / "dd"), data_split="test"), SEQ2SEQ)) == 3
    # held out: validation, else test
    held = open_data(_cfg(data=str(tmp_path / "dd"), eval_data=str(tmp_path / "dd")), SEQ2SEQ, split="eval")
    assert len(held) == 3
    with pytest.raises(DataError, match="has no split 'dev'; its splits are train, test: pass --data-split"):
        open_data(_cfg(data=str(tmp_path / "dd"), data_split="dev"), SEQ2SEQ)


def test_tokenising_is_cached_between_runs_and_no_cache_redoes_it(tmp_path):
    spec = _write_all_formats(tmp_path, _rows())["parquet"]
    first = load_dataset(_cfg(data=spec), SEQ2SEQ, TOK, 384).examples.table.cache_files
    again = load_dataset(_cfg(data=spec), SEQ2SEQ, TOK, 384).examples.table.cache_files
    assert first == again and len(first) == 1
    stamp = (tmp_path / first[0]["filename"]).stat().st_mtime_ns
    load_dataset(_cfg(data=spec), SEQ2SEQ, TOK, 384)
    assert (tmp_path / first[0]["filename"]).stat().st_mtime_ns == stamp  # reused, not rewritten
    load_dataset(_cfg(data=spec, cache=False), SEQ2SEQ, TOK, 384)
    from pathlib import Path

    assert Path(first[0]["filename"]).stat().st_mtime_ns != stamp  # --no-cache tokenised again


# -- chat messages ----------------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Bye."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


def _chat_file(tmp_path, n: int = 1):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATIONS[i % 2]}) + "\n" for i in range(n)))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    return path, template


def test_chat_labels_are_the_assistant_turns_token_by_token(tmp_path):
    path, template = _chat_file(tmp_path, n=2)
    data = load_dataset(_cfg(model="gpt2-tiny", data=str(path), chat_template=str(template), seq_len=512),
                        CAUSAL, ByT5Tokenizer(), 384)
    for example, messages in zip(data.examples, CONVERSATIONS):
        # expected from the text alone: ByT5 is one token per byte, so a character's token is its byte + 3
        text, learn = "", []
        for m in messages:
            header = f"<|im_start|>{m['role']}\n"
            body = f"{m['content']}<|im_end|>\n"
            text += header + body
            learn += [False] * len(header) + [m["role"] == "assistant"] * len(body)
        assert example.input_ids == [b + 3 for b in text.encode()]
        assert example.labels == [t if on else IGNORE_INDEX for t, on in zip(example.input_ids, learn)]
    assert data.truncated == 0 and data.dropped == 0


@pytest.mark.parametrize("bos", [True, False])
def test_the_labels_are_exactly_the_assistant_turns_tokens_of_a_bpe_tokenizer(tmp_path, bos):
    """A user's BPE tokenizer (tests/user_models.py) with ChatML's markers as special tokens: the batch training
    sees takes the loss on exactly each assistant reply and its end-of-turn marker, never on a role header, a
    user or system turn or the BOS, and the conversation's tokens are the tokenizer's own for the whole text."""
    from user_models import tokenizer

    tok = tokenizer(tmp_path / "tok", bos=bos)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    template = tmp_path / "chatml-bos.jinja"
    template.write_text("{% if bos_token %}{{ bos_token }}{% endif %}" + CHATML)
    path, _ = _chat_file(tmp_path, n=2)
    data = load_dataset(_cfg(model="gpt2-tiny", data=str(path), chat_template=str(template), seq_len=512), CAUSAL,
                        tok, len(tok))
    batch = collate(list(data.examples), CAUSAL, pad_id=tok.pad_token_id)
    for row, (example, messages) in enumerate(zip(data.examples, CONVERSATIONS, strict=True)):
        ids, learnt = ([tok.bos_token_id], [False]) if bos else ([], [])
        for m in messages:
            header = tok(f"<|im_start|>{m['role']}\n", add_special_tokens=False)["input_ids"]
            body = tok(f"{m['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
            ids, learnt = ids + header + body, learnt + [False] * len(header) + [m["role"] == "assistant"] * len(body)
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert example.input_ids == ids == tok(rendered, add_special_tokens=False)["input_ids"]
        n = len(ids)
        assert batch["labels"][row, :n].tolist() == [t if on else IGNORE_INDEX for t, on in zip(ids, learnt)]
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()  # padding
        replies = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert tok.decode([t for t, on in zip(ids, learnt) if on]) == replies


def test_chat_data_without_a_template_is_one_line(tmp_path, tiny_gpt_dir):
    path, _ = _chat_file(tmp_path, n=8)
    rc, _, err = run_main(["train", "--model", str(tiny_gpt_dir), "--data", str(path), "--device", "cpu",
                           "--precision", "fp32", "--batch-size", "2", "--max-steps", "1", "--eval-examples", "0",
                           "--no-progress"])
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "has no chat template: give one with --chat-template FILE" in lines[0], err


def _write_chats(tmp_path, conversations) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) if c is not None else json.dumps({"id": 0}) + "\n"
                            for c in conversations).replace("}{", "}\n{") + "\n")
    return str(path)


def test_an_unknown_chat_role_is_one_line_naming_the_row(tmp_path, tiny_gpt_dir):
    """A misspelled 'assistant' would render as a turn of its own, leave nothing to learn and be dropped as
    if too long; it is refused before the model loads, naming the row and the roles."""
    typo = [{"role": "user", "content": "Hi"}, {"role": "assitant", "content": "Hello!"}]
    path = _write_chats(tmp_path, [CONVERSATIONS[0], CONVERSATIONS[1], typo, CONVERSATIONS[1]])
    with pytest.raises(DataError, match=r"chats.jsonl: example 3: unknown chat role 'assitant' \(did you mean "
                                        r"'assistant'\? the roles are system, developer, user, assistant, tool"):
        open_data(_cfg(model="gpt2-tiny", data=path), CAUSAL)
    _, template = _chat_file(tmp_path)
    rc, _, err = run_main(["train", "--model", str(tiny_gpt_dir), "--data", path, "--chat-template", str(template),
                           "--device", "cpu", "--precision", "fp32", "--batch-size", "2", "--max-steps", "1",
                           "--eval-examples", "0", "--no-progress", "--out", str(tmp_path / "run")])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "example 3: unknown chat role 'assitant'" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_a_malformed_conversation_names_its_row(tmp_path):
    import datasets

    from fitone.data.chat import check_chat

    no_content = [{"role": "user", "content": "Hi"}, {"role": "assistant"}]
    cases = [
        ([CONVERSATIONS[1], no_content], r"example 2: 'messages' must be a list of \{role, content\} objects with "
                                         r"text values; got \{'role': 'assistant'\}"),
        ([CONVERSATIONS[1], CONVERSATIONS[0], None], "example 3: 'messages' must be .*; got None"),
        ([CONVERSATIONS[1], [{"role": "robot", "content": "beep"}]], r"example 2: unknown chat role 'robot' \(the "
                                                                      "roles are"),
    ]
    for conversations, pattern in cases:
        with pytest.raises(DataError, match=pattern):
            open_data(_cfg(model="gpt2-tiny", data=_write_chats(tmp_path, conversations)), CAUSAL)
    (tmp_path / "flat.jsonl").write_text(json.dumps({"messages": ["Hi", "Hello!"]}) + "\n")
    with pytest.raises(DataError, match=r"flat.jsonl: example 1: 'messages' must be a list of \{role, content\} "
                                        r"objects with text values; got Hi"):
        open_data(_cfg(model="gpt2-tiny", data=str(tmp_path / "flat.jsonl")), CAUSAL)
    # Arrow's column-wise search (one struct type), rows counted across the table's chunks: the first bad
    # row is the 10th, in the third chunk (the 11th is wrong too)
    good = datasets.Dataset.from_list([{"messages": CONVERSATIONS[1]}] * 4)
    bad = datasets.Dataset.from_list([{"messages": CONVERSATIONS[1]}, {"messages": [{"role": "user", "content": None}]},
                                      {"messages": [{"role": "asistant", "content": "4"}]}])
    table = datasets.concatenate_datasets([good, good, bad])
    assert table.data.column("messages").num_chunks == 3
    with pytest.raises(DataError, match="chunks: example 10: 'messages' must be .*; got {'role': 'user', 'content': "
                                        "None}"):
        check_chat(table, "chunks")
    with pytest.raises(DataError, match="chunks: example 10: unknown chat role 'asistant'"):
        check_chat(datasets.concatenate_datasets([good, good, bad.select([0, 2]).flatten_indices()]), "chunks")


def test_a_messages_file_trains_a_tiny_causal_lm(tmp_path, tiny_gpt_dir):
    import fitone

    path, template = _chat_file(tmp_path, n=32)
    result = fitone.train(model=str(tiny_gpt_dir), data=str(path), chat_template=str(template), seq_len=128,
                          batch_size=4, max_steps=8, lr=3e-3, precision="fp32", device="cpu", eval_examples=0,
                          progress=False, out=str(tmp_path / "run"))
    assert result.steps == 8 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]
    # the template travels with the exported tokenizer, so the model is used with the format it learnt
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(result.final_dir).chat_template == CHATML


# -- packing ----------------------------------------------------------------------------------------
def _lm(attn: str):
    from fitone.models import build_model, load_config

    config = load_config("gpt2-tiny", from_scratch=True)
    config._attn_implementation = attn
    config.use_cache = False  # as in training: with a KV cache transformers does not look for packed rows
    torch.manual_seed(0)
    return build_model(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_batch_has_the_loss_of_its_examples_unpacked(attn):
    import datasets

    from fitone.data.examples import ArrowExamples, Example

    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 9, 3, 30, 12, 7, 21]
    examples = [Example(ids, list(ids)) for ids in
                (torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths)]
    table = datasets.Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                        "labels": [e.labels for e in examples]})
    packed = ArrowExamples(pack_examples(table, 40, pad_id=0))
    assert len(packed) < len(examples) and all(len(packed[i].input_ids) == 40 for i in range(len(packed)))
    model = _lm(attn)
    with torch.no_grad():
        unpacked_loss = model(**collate(examples, CAUSAL, pad_id=0)).loss
        batch = collate(list(packed), CAUSAL, pad_id=0)
        assert "attention_mask" not in batch  # transformers reads the boundaries from the position ids
        packed_loss = model(**batch).loss
        # the same rows as one long sequence each: examples see each other and the loss moves
        crossed = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(packed_loss, unpacked_loss, rtol=1e-5, atol=1e-6)
    assert abs(float(crossed) - float(unpacked_loss)) > 1e-3


def test_pack_fills_rows_with_whole_examples_and_keeps_every_label(tmp_path):
    path = tmp_path / "t.jsonl"
    texts = ["a" * (1 + (i * 7) % 25) for i in range(60)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = _cfg(model="gpt2-tiny", data=str(path), seq_len=32)
    plain = load_dataset(cfg, CAUSAL, TOK, 384)
    packed = load_dataset(dataclasses.replace(cfg, pack=True), CAUSAL, TOK, 384)
    assert packed.packed_from == 60 and len(packed) < len(plain)
    rows = list(packed.examples)
    assert all(len(r.input_ids) == len(r.position_ids) == 32 for r in rows)
    learnt = sum(sum(y != IGNORE_INDEX for y in e.labels[1:]) for e in plain.examples)
    assert sum(sum(y != IGNORE_INDEX for y in r.labels) for r in rows) == learnt
    with pytest.raises(ConfigError, match="--pack is for causal LMs"):
        open_data(_cfg(data=str(path), pack=True), SEQ2SEQ)


@pytest.mark.parametrize("bos", [True, False])
def test_packed_position_ids_restart_at_each_example_and_no_label_crosses_one(tmp_path, bos):
    """Prompt + text rows (some with an empty prompt) of a user's BPE tokenizer, packed: cut at each position
    id 0, a row is its examples whole and in order (each with its BOS), then padding; positions count 0, 1,
    2... within each; an example's labels are its own (its prompt ignored), and the first of each is ignored,
    since predicting it would read the example before it."""
    from user_models import tokenizer

    tok = tokenizer(tmp_path / "tok", bos=bos)
    path = tmp_path / "sft.jsonl"
    rows = [{"q": "question: nine" * (i % 3), "a": "hello world " * (1 + i % 4)} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(model="gpt2-tiny", data=str(path), prompt_field="q", text_field="a", seq_len=48)
    plain = [(e.input_ids, e.labels) for e in load_dataset(cfg, CAUSAL, tok, len(tok)).examples]
    packed = load_dataset(dataclasses.replace(cfg, pack=True), CAUSAL, tok, len(tok))
    batch = collate(list(packed.examples), CAUSAL, pad_id=tok.pad_token_id)
    seen = []
    for ids, labels, pos in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))
            assert labels[a] == IGNORE_INDEX  # no label is predicted across a boundary
            seen.append((ids[a:b], labels[a:b]))
    assert len(packed) < len(plain)  # rows hold several examples
    examples, pads = [], []
    for piece in seen:  # a row's padding is the last piece of its row
        (pads if piece[0][0] == tok.pad_token_id else examples).append(piece)
    assert [ids for ids, _ in examples] == [ids for ids, _ in plain]
    assert all(ids[0] == tok.bos_token_id for ids, _ in examples) == bos
    assert [labels for _, labels in examples] == [[IGNORE_INDEX] + labels[1:] for _, labels in plain]
    assert all(set(labels) == {IGNORE_INDEX} for _, labels in pads)


def test_the_probes_packed_worst_case_batch_is_full_and_packed():
    batch = worst_case_batch(CAUSAL, 3, _cfg(model="gpt2-tiny", seq_len=64, pack=True), 384, 0)
    assert batch["input_ids"].shape == (3, 64) and "attention_mask" not in batch
    assert (batch["position_ids"] == 0).sum(dim=1).tolist() == [4, 4, 4]  # four examples per row


# -- memory -----------------------------------------------------------------------------------------
def _fast_gpt_dir(path):
    """gpt2-tiny with a fast byte-level tokenizer (Rust): 200k rows tokenise in seconds, not minutes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fitone.models import build_model, load_config

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>") \
        .save_pretrained(path)
    build_model(load_config("gpt2-tiny", from_scratch=True)).save_pretrained(path)
    return path


def _peak_rss_of_training(model_dir, data, out, tmp_path) -> int:
    """Peak RSS (bytes) of a `fitone train` child, read in a fresh parent whose only child it is."""
    argv = [sys.executable, "-m", "fitone", "train", "--model", str(model_dir), "--data", str(data),
            "--seq-len", "16", "--batch-size", "4", "--max-steps", "3", "--device", "cpu", "--precision", "fp32",
            "--eval-examples", "0", "--no-progress", "--out", str(out)]
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = child_env() | {"HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def test_a_200k_row_parquet_trains_without_being_read_into_memory(tmp_path):
    """Peak RSS of training on 200k rows (a 1 KB column each, ~200 MB) against 1k rows of the same kind:
    the difference is a small part of the data, because rows are read from the memory-mapped cache, one
    batch at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    model_dir = _fast_gpt_dir(tmp_path / "gpt")
    rng = np.random.default_rng(0)

    def write(path, n):  # in row groups, so the test itself never holds the file either
        schema = pa.schema([("text", pa.string()), ("meta", pa.string())])
        size = 0
        with pq.ParquetWriter(path, schema) as writer:
            for start in range(0, n, 10_000):
                k = min(10_000, n - start)
                blob = rng.integers(0, 2**63, size=(k, 64), dtype=np.uint64)
                part = pa.table({"text": [f"w{i % 97} w{i % 13}" for i in range(start, start + k)],
                                 "meta": [row.tobytes().hex() for row in blob]}, schema=schema)
                writer.write_table(part)
                size += part.nbytes
        return size

    write(tmp_path / "small.parquet", 1_000)
    big_bytes = write(tmp_path / "big.parquet", 200_000)
    assert big_bytes > 190 * 2**20
    # the one-time conversion into datasets' cache (and the tokenising) happen here first, as a first run
    # would; the measured runs read from the cache, as every later run does
    from fitone.data.tokens import tokenize
    from fitone.models import load_config, load_tokenizer

    for name in ("small", "big"):
        cfg = TrainConfig(model=str(model_dir), data=str(tmp_path / f"{name}.parquet"), seq_len=16,
                          progress=False).data_settings()
        config = load_config(str(model_dir), from_scratch=False)
        tokenize(open_data(cfg, CAUSAL), CAUSAL, load_tokenizer(str(model_dir), config, from_scratch=False), cfg)
    small = _peak_rss_of_training(model_dir, tmp_path / "small.parquet", tmp_path / "run-small", tmp_path)
    big = _peak_rss_of_training(model_dir, tmp_path / "big.parquet", tmp_path / "run-big", tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "run-big" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert big - small < big_bytes / 4, (small, big, big_bytes)
