"""Data is tokenised as the model's own tokenizer tokenises it: its BOS where it adds one, EOS once at the end,
for text rows, prompt + text rows, packed rows and seq2seq pairs; checked token by token against the tokenizer.

The tokenizers are the ones users bring: tests/user_models.py's BPE tokenizer (BOS-adding or not, saved and
loaded back as a run loads it) and the same vocabulary under the architectures' own tokenizer classes, which
decide for themselves what they add (Llama and Mistral, Gemma and OPT add a BOS, OPT's being its EOS id;
Qwen2 and GPT-NeoX add none; one Llama tokenizer appends EOS itself, as T5's and ByT5's do).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, ByT5Tokenizer
from user_models import tokenizer as user_tokenizer

from fitone.config import DataSettings, TrainConfig
from fitone.data import IGNORE_INDEX, load_dataset
from fitone.models import CAUSAL, SEQ2SEQ

SPECIALS = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
# name -> (tokenizer class and options, or the user_models kind; adds BOS; appends EOS itself)
KINDS = {
    "user-bos": ("user", dict(bos=True), True, False),
    "user-no-bos": ("user", dict(bos=False), False, False),
    "llama": ("LlamaTokenizer", dict(add_bos_token=True), True, False),
    "llama-adds-eos": ("LlamaTokenizer", dict(add_bos_token=True, add_eos_token=True), True, True),
    "gemma": ("GemmaTokenizer", dict(SPECIALS, mask_token="<unk>", add_bos_token=True), True, False),
    "opt": ("GPT2Tokenizer", dict(SPECIALS, bos_token="</s>", add_bos_token=True), True, False),
    "qwen2": ("Qwen2Tokenizer", dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>"), False, False),
    "gpt_neox": ("GPTNeoXTokenizer", SPECIALS, False, False),
    "byt5": ("ByT5Tokenizer", {}, False, True),
}
BOS_KINDS = [k for k, v in KINDS.items() if v[2]]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "nine hundred ninety-nine"]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """name -> the tokenizer as a run loads it (AutoTokenizer on its saved directory)."""
    import transformers

    root = tmp_path_factory.mktemp("tokenizers")
    user_tokenizer(root / "bpe", bos=False)
    bpe = json.loads((root / "bpe" / "tokenizer.json").read_text())["model"]
    vocab, merges = bpe["vocab"], [tuple(m) for m in bpe["merges"]]
    out = {}
    for name, (kind, options, _, _) in KINDS.items():
        if kind == "user":
            user_tokenizer(root / name, **options)
        elif kind == "ByT5Tokenizer":
            ByT5Tokenizer().save_pretrained(root / name)
        else:
            getattr(transformers, kind)(vocab=vocab, merges=merges, **options).save_pretrained(root / name)
        out[name] = AutoTokenizer.from_pretrained(root / name)
    return out


def _cfg(path, **kw) -> DataSettings:
    return TrainConfig(**{"model": "gpt2-tiny", "data": str(path), "progress": False, "seq_len": 128,
                          **kw}).data_settings()


def _write(tmp_path, rows) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _own(tok, text: str, adds_eos: bool) -> list[int]:
    """What the tokenizer itself gives for a text, with EOS appended once where it does not append one."""
    return tok(text)["input_ids"] + ([] if adds_eos else [tok.eos_token_id])


@pytest.mark.parametrize("name", KINDS)
def test_text_rows_are_the_tokenizers_own_ids_with_one_eos(tmp_path, tokenizers, name):
    tok, (_, _, adds_bos, adds_eos) = tokenizers[name], KINDS[name]
    data = load_dataset(_cfg(_write(tmp_path, [{"text": t} for t in TEXTS])), CAUSAL, tok, len(tok))
    for example, text in zip(data.examples, TEXTS, strict=True):
        want = _own(tok, text, adds_eos)
        assert example.input_ids == want, (name, text)
        assert want[-1] == tok.eos_token_id and want[-2] != tok.eos_token_id  # EOS once
        assert (want[0] == tok.bos_token_id) == adds_bos  # the case is what it says
        lead = 1 if adds_bos else 0  # the BOS is fed, never learnt: the loss is on the text and its EOS
        assert example.labels == [IGNORE_INDEX] * lead + want[lead:]


@pytest.mark.parametrize("name", KINDS)
def test_a_prompt_starts_with_the_one_bos_and_the_text_gets_none(tmp_path, tokenizers, name):
    tok, (_, _, _, adds_eos) = tokenizers[name], KINDS[name]
    rows = [{"q": "question: " + t, "a": t} for t in TEXTS]
    data = load_dataset(_cfg(_write(tmp_path, rows), prompt_field="q", text_field="a"), CAUSAL, tok, len(tok))
    for example, row in zip(data.examples, rows, strict=True):
        prompt = tok(row["q"])["input_ids"][: -1 if adds_eos else None]  # the tokenizer's start, no end yet
        text = tok(row["a"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert example.input_ids == prompt + text, name
        assert example.labels == [IGNORE_INDEX] * len(prompt) + text


@pytest.mark.parametrize("name", BOS_KINDS)
def test_truncation_keeps_the_bos_first(tmp_path, tokenizers, name):
    tok, adds_eos = tokenizers[name], KINDS[name][3]
    long_text = " ".join(TEXTS * 3)
    data = load_dataset(_cfg(_write(tmp_path, [{"text": long_text}]), seq_len=7), CAUSAL, tok, len(tok))
    (example,) = data.examples
    assert data.truncated == 1 and example.input_ids == _own(tok, long_text, adds_eos)[:7]
    assert example.input_ids[0] == tok.bos_token_id
    # prompt + text: the BOS, then the end of the prompt, then the start of the text
    rows = [{"q": long_text, "a": long_text}]
    data = load_dataset(_cfg(_write(tmp_path, rows), prompt_field="q", text_field="a", seq_len=9), CAUSAL, tok,
                        len(tok))
    (example,) = data.examples
    prompt = tok(long_text, add_special_tokens=False)["input_ids"]
    text = tok(long_text, add_special_tokens=False)["input_ids"]
    assert data.truncated == 1 and len(example.input_ids) == 9
    assert example.input_ids == [tok.bos_token_id] + prompt[-1:] + text[:7]
    assert example.labels == [IGNORE_INDEX] * 2 + text[:7]


@pytest.mark.parametrize("name", ["user-bos", "opt", "qwen2"])
def test_each_packed_example_keeps_its_own_bos(tmp_path, tokenizers, name):
    tok = tokenizers[name]
    path = _write(tmp_path, [{"text": t} for t in TEXTS * 4])
    plain = load_dataset(_cfg(path, seq_len=32), CAUSAL, tok, len(tok))
    packed = load_dataset(_cfg(path, seq_len=32, pack=True), CAUSAL, tok, len(tok))
    pieces = []
    for row in packed.examples:
        starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
        pieces += [row.input_ids[a:b] for a, b in zip(starts, starts[1:])]
    # every example, whole and with its BOS, then each row's padding
    examples = [e.input_ids for e in plain.examples]
    assert [p for p in pieces if p[0] != tok.pad_token_id] == examples
    assert examples[0] == _own(tok, TEXTS[0], KINDS[name][3])


@pytest.mark.parametrize("name", ["user-bos", "user-no-bos", "opt", "byt5"])
def test_seq2seq_pairs_are_the_tokenizers_own_ids_with_one_eos(tmp_path, tokenizers, name):
    tok, (_, _, adds_bos, adds_eos) = tokenizers[name], KINDS[name]
    rows = [{"source": t, "target": t.upper()} for t in TEXTS]
    data = load_dataset(TrainConfig(model="t5-tiny", data=_write(tmp_path, rows), progress=False, src_len=64,
                                    tgt_len=64).data_settings(), SEQ2SEQ, tok, len(tok))
    for example, row in zip(data.examples, rows, strict=True):
        assert example.input_ids == tok(row["source"])["input_ids"], name  # as the tokenizer gives it
        # the target ends with EOS once, so the model learns to stop (appended where the tokenizer adds none)
        assert example.labels == _own(tok, row["target"], adds_eos)
        assert example.labels[-2] != tok.eos_token_id
    # truncated: the BOS stays first, the tokenizer's own end stays last
    long_row = {"source": " ".join(TEXTS * 3), "target": " ".join(TEXTS * 3)}
    data = load_dataset(TrainConfig(model="t5-tiny", data=_write(tmp_path, [long_row]), progress=False, src_len=8,
                                    tgt_len=8).data_settings(), SEQ2SEQ, tok, len(tok))
    (example,) = data.examples
    source, target = tok(long_row["source"])["input_ids"], _own(tok, long_row["target"], adds_eos)
    assert data.truncated == 1
    assert example.input_ids == (source[:7] + source[-1:] if adds_eos else source[:8])
    assert example.labels == target[:7] + [tok.eos_token_id]
    assert (example.input_ids[0] == tok.bos_token_id) == adds_bos


def test_rows_tokenised_before_the_bos_was_kept_are_not_read_from_the_cache(tmp_path, tokenizers):
    """A cache written by the tokenising that dropped the BOS (its key recomputed here as that code made it)
    is not reused: the rows are tokenised again, with the BOS."""
    from datasets.fingerprint import Hasher

    from fitone.data import open_data

    tok = tokenizers["user-bos"]
    cfg = _cfg(_write(tmp_path, [{"text": t} for t in TEXTS]))
    table = open_data(cfg, CAUSAL).table
    old_key = Hasher.hash([table._fingerprint, Hasher.hash(tok), getattr(tok, "chat_template", None), "tokenise",
                           CAUSAL, ("text",), (cfg.seq_len,), "tuple"])

    def without_bos(batch):
        ids = [i + [tok.eos_token_id] for i in tok(batch["text"], add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "labels": ids, "length": [len(i) for i in ids], "truncated": [False] * len(ids)}

    table.select_columns(["text"]).map(without_bos, batched=True, remove_columns=["text"], new_fingerprint=old_key)
    data = load_dataset(cfg, CAUSAL, tok, len(tok))
    assert [e.input_ids for e in data.examples] == [_own(tok, t, False) for t in TEXTS]


@pytest.mark.parametrize("arch,bos", [("llama3", True), ("qwen2", False), ("bart", True)])
def test_a_users_model_trains_on_rows_tokenised_with_its_own_specials(tmp_path, arch, bos):
    """Real engines on tiny user model directories (tests/user_models.py), prompt + text rows (source/target
    for BART) with and without a BOS: the loss falls and the held-out score runs."""
    import torch
    from user_models import SEQ2SEQ as SEQ2SEQ_ARCHS
    from user_models import model_dir

    import fitone

    model = model_dir(arch, tmp_path / arch, bos=bos)
    seq2seq = arch in SEQ2SEQ_ARCHS
    rows = [{"q": f"question: {t}", "a": t} for t in TEXTS] * 16
    fields = dict(source_field="q", target_field="a") if seq2seq else dict(prompt_field="q", text_field="a",
                                                                           seq_len=32)
    data = _write(tmp_path, rows)
    result = fitone.train(model=str(model), data=data, eval_data=data, eval_examples=8, batch_size=4, max_steps=12,
                          lr=3e-3, precision="fp32", device="cpu", progress=False, out=str(tmp_path / "run"),
                          **fields)
    assert result.steps == 12 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]
    assert result.evals and 0 < result.evals[-1]["eval_loss"] < float("inf")
