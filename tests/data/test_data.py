"""Reading, tokenising and batching data; every malformed input names the file and line."""

import json

import pytest
import torch
from transformers import ByT5Tokenizer

from fitone.config import TrainConfig
from fitone.data import SAMPLE_EVAL, IGNORE_INDEX, batches, collate, load_dataset, open_data, worst_case_batch
from fitone.errors import ConfigError, DataError
from fitone.models import CAUSAL, SEQ2SEQ

TOK = ByT5Tokenizer()


def _cfg(**kw):
    return TrainConfig(model="t5-tiny", **kw).data_settings()


def read_rows(path, fields):
    """Open and check a data file as a run does (seq2seq: source/target; causal: text)."""
    task = SEQ2SEQ if len(fields) == 2 else CAUSAL
    return open_data(_cfg(data=str(path), progress=False), task)


@pytest.mark.parametrize("lines,fragment", [
    (['{"source": "a", "target": "b"}', "{oops"], ":2: not valid JSON"),
    (['{"source": "a"}'], r"has no field 'target' \(its fields: source\).*--target-field"),
    (['{"source": "a", "target": "b"}', '{"source": "c"}'], r"example 2: missing field 'target'.*--target-field"),
    (['{"source": "a", "target": 3}'], "example 1: field 'target' must be text, got int"),
    (['{"source": "a", "target": "b"}', '{"source": "a", "target": [3]}'], "example 2: field 'target' must be "
                                                                              "text, got list"),
    (['{"source": "a", "target": "b"}', '[1, 2]'], ":2: expected a JSON object"),
    (["", "  "], "holds no examples"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, lines, fragment):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=fragment):
        read_rows(f, ("source", "target"))


def test_invalid_json_names_its_line_and_column(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"source": "a", "target": "b"}\n\n{"source": "a\tb", "target": "c"}\n')  # a raw tab, line 3
    with pytest.raises(DataError) as caught:
        read_rows(f, ("source", "target"))
    assert str(caught.value) == (f"{f}:3: not valid JSON at column 14 (Invalid control character); each line must "
                                 "be one JSON object")


def test_missing_and_directory_and_binary(tmp_path):
    with pytest.raises(DataError, match=r"nope.jsonl does not exist: give the path of a .jsonl/.json, .csv or "
                                        r".parquet file, a glob of them or a save_to_disk directory, 'sample' or "
                                        r"'synthetic'"):
        read_rows(tmp_path / "nope.jsonl", ("text",))
    with pytest.raises(DataError, match=r"nope.csv does not exist: give the path of a .jsonl/.json, .csv or .parquet"):
        read_rows(tmp_path / "nope.csv", ("text",))
    with pytest.raises(DataError, match="is a directory"):
        read_rows(tmp_path, ("text",))
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="UTF-8"):
        read_rows(bad, ("text",))


def test_datasets_own_bars_show_only_with_verbose_and_the_tokenising_bar_stays(tmp_path, capfd, monkeypatch):
    """A quiet run shows fitone's own bar (tokenising) but not datasets' "Generating train split"."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # a fresh cache: the conversion runs each time
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    datasets.enable_progress_bars()
    f = tmp_path / "d.jsonl"
    f.write_text('{"source": "a", "target": "b"}\n')
    load_dataset(_cfg(data=str(f)), SEQ2SEQ, TOK, 384)
    quiet = capfd.readouterr().err
    assert "Generating train split" not in quiet and "tokenising" in quiet, quiet
    f.write_text('{"source": "c", "target": "d"}\n')  # new rows: converted again
    load_dataset(_cfg(data=str(f), verbose=True), SEQ2SEQ, TOK, 384)
    assert "Generating train split" in capfd.readouterr().err
    load_dataset(_cfg(data=str(f), progress=False), SEQ2SEQ, TOK, 384)
    assert capfd.readouterr().err == ""
    assert datasets.is_progress_bar_enabled()  # left as it was


def test_custom_field_names_and_truncation_count(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"q": "x" * n, "a": "y"}) for n in (3, 10, 30)) + "\n")
    data = load_dataset(_cfg(data=str(f), source_field="q", target_field="a", src_len=12), SEQ2SEQ, TOK, 384)
    assert len(data) == 3 and data.truncated == 1
    assert all(len(e.input_ids) <= 12 for e in data.examples)
    assert data.examples[2].input_ids[-1] == TOK.eos_token_id  # truncation keeps the end token


def test_sample_task_has_train_and_held_out_splits():
    train = load_dataset(_cfg(), SEQ2SEQ, TOK, 384)
    held = load_dataset(_cfg(), SEQ2SEQ, TOK, 384, split="eval")
    assert len(train) == 9500 and len(held) == 500
    assert not {r["source"] for r in train.raw} & {r["source"] for r in held.raw}
    with pytest.raises(ConfigError, match="seq2seq"):
        load_dataset(_cfg(), CAUSAL, TOK, 384)


def test_the_held_out_examples_are_the_eval_splits_first_n_in_order(tmp_path):
    """As docs/guide.md says: --eval-data's validation split, else its test split, scored on its first
    --eval-examples examples in the data's own order."""
    import datasets

    from fitone.data import Dataset
    from fitone.evaluate import HeldOut, evaluate
    from fitone.models import build_model, load_config

    def rows(split, n=6):
        return [{"source": f"{split} {i}", "target": str(i)} for i in range(n)]

    splits = {"train": rows("train", 8), "test": rows("test"), "validation": rows("validation")}
    for name, keep in (("both", ("train", "test", "validation")), ("test-only", ("train", "test"))):
        datasets.DatasetDict({k: datasets.Dataset.from_list(splits[k]) for k in keep}).save_to_disk(tmp_path / name)
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("file")))
    for spec, split in ((tmp_path / "both", "validation"), (tmp_path / "test-only", "test"),
                        (tmp_path / "dev.jsonl", "file")):
        held = load_dataset(_cfg(data="sample", eval_data=str(spec)), SEQ2SEQ, TOK, 384, split="eval")
        assert [r["source"] for r in held.raw] == [f"{split} {i}" for i in range(6)]
        assert [e.input_ids for e in held.examples] == [TOK(r["source"]).input_ids for r in held.raw]
    sample = load_dataset(_cfg(), SEQ2SEQ, TOK, 384, split="eval")
    first = [json.loads(line) for line in SAMPLE_EVAL.read_text().splitlines()[:3]]
    assert [dict(r) for r in sample.raw[:3]] == first

    # scoring reads the first N (here in chunks of 3 and 1), not any other N
    torch.manual_seed(0)
    model = build_model(load_config("t5-tiny", from_scratch=True)).eval()
    cpu = torch.device("cpu")

    def score(data, n):
        return evaluate(model, TOK, HeldOut(data, examples=n, answer_field="target", batch=3, pad_id=0, tgt_len=6),
                        cpu)

    examples, raw = list(held.examples), list(held.raw)
    scored = score(held, 4)
    assert scored == score(Dataset(SEQ2SEQ, examples[:4], raw=raw[:4]), 4)
    assert scored["eval_loss"] != score(Dataset(SEQ2SEQ, examples[2:6], raw=raw[2:6]), 4)["eval_loss"]


def test_collate_pads_dynamically_and_masks_labels():
    from fitone.data import Example

    batch = collate([Example([5, 6, 1], [7, 1]), Example([5, 1], [7, 8, 9, 1])], SEQ2SEQ, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 1], [5, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 1, IGNORE_INDEX, IGNORE_INDEX], [7, 8, 9, 1]]


def test_a_prompt_field_is_fed_but_not_trained_on(tmp_path):
    """--prompt-field (causal): input = prompt + text + EOS, labels IGNORE over the prompt and padding."""
    f = tmp_path / "sft.jsonl"
    rows = [{"instruction": "ab", "answer": "cd"}, {"instruction": "p" * 20, "answer": "t" * 20}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(data=str(f), prompt_field="instruction", text_field="answer", seq_len=16)
    data = load_dataset(cfg, CAUSAL, TOK, 384)
    ab, cd, eos = TOK("ab", add_special_tokens=False).input_ids, TOK("cd", add_special_tokens=False).input_ids, 1
    short, long_ = data.examples
    assert short.input_ids == ab + cd + [eos] and short.labels == [IGNORE_INDEX] * 2 + cd + [eos]
    # too long: the text keeps its start (15 of its 21 tokens), the prompt its last token, next to the text
    assert data.truncated == 1 and len(long_.input_ids) == 16
    assert long_.labels == [IGNORE_INDEX] + long_.input_ids[1:] and long_.input_ids[0] == ord("p") + 3
    batch = collate([short, long_], CAUSAL, pad_id=0)
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * 2 + cd + [eos] + [IGNORE_INDEX] * 11
    assert batch["labels"][1].tolist() == long_.labels
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"answer": "x"}) + "\n")
    with pytest.raises(DataError, match=r"has no field 'instruction' \(its fields: answer\).*--prompt-field"):
        load_dataset(_cfg(data=str(plain), prompt_field="instruction", text_field="answer"), CAUSAL, TOK, 384)
    with pytest.raises(ConfigError, match="name two different fields"):
        _cfg(prompt_field="text")
    from fitone.data import data_file

    for data in ("sample", "synthetic", str(f)):  # train and probe-batch alike, whatever the data
        with pytest.raises(ConfigError, match="--prompt-field is for causal LMs; t5-tiny is seq2seq"):
            data_file(_cfg(data=data, prompt_field="instruction"), SEQ2SEQ)


def test_batches_resume_where_they_left_off_and_ranks_split():
    data = load_dataset(_cfg(), SEQ2SEQ, TOK, 384)
    straight = batches(data, 4, seed=1, pad_id=0)
    seen = [next(straight) for _ in range(2380)]  # past the end of epoch 0 (2375 batches)
    assert seen[2375][0] == 1 and seen[2375][1] == 0
    resumed = batches(data, 4, seed=1, pad_id=0, start_epoch=1, start_batch=3)
    e, b, batch = next(resumed)
    assert (e, b) == (1, 3) and batch["input_ids"].equal(seen[2378][2]["input_ids"])


def _rows(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A batch's examples without their padding (batches of other sizes pad to other widths)."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["labels"]
    return [(tuple(i[m].tolist()), tuple(y[y != IGNORE_INDEX].tolist())) for i, m, y in zip(ids, mask, labels)]


def test_two_ranks_together_see_what_one_process_sees_at_the_same_global_batch():
    """Rank 0 then rank 1 at micro-batch 2 hold exactly the examples of one process's micro-batch of 4, and of
    its two accumulated micro-batches of 2, step after step and in the same order (tests/test_distributed.py
    compares the losses this gives)."""
    data = load_dataset(_cfg(), SEQ2SEQ, TOK, 384)
    ranks = [batches(data, 2, seed=1, pad_id=0, rank=r, world_size=2) for r in (0, 1)]
    whole = batches(data, 4, seed=1, pad_id=0)
    accumulated = batches(data, 2, seed=1, pad_id=0)
    for _ in range(5):
        split = [_rows(next(stream)[2]) for stream in ranks]
        assert split[0] != split[1]
        assert split[0] + split[1] == _rows(next(whole)[2])
        assert split[0] + split[1] == _rows(next(accumulated)[2]) + _rows(next(accumulated)[2])


def test_worst_case_batch_uses_full_lengths_or_longest_examples(tmp_path):
    synth = worst_case_batch(SEQ2SEQ, 3, _cfg(src_len=20, tgt_len=7), 384, 0)
    assert synth["input_ids"].shape == (3, 20) and synth["labels"].shape == (3, 7)
    causal = worst_case_batch(CAUSAL, 2, _cfg(seq_len=33), 384, 0)
    assert causal["input_ids"].shape == (2, 33)
    data = load_dataset(_cfg(), SEQ2SEQ, TOK, 384)
    longest = max(len(e.input_ids) + len(e.labels) for e in data.examples)
    batch = worst_case_batch(SEQ2SEQ, 4, _cfg(), 384, 0, data)
    assert batch["input_ids"].shape[1] + batch["labels"].shape[1] == longest


def test_synthetic_data_is_a_function_of_the_seed_and_full_length():
    """Two dataset objects built apart (as a resumed run or another rank builds its own) hold the same
    examples for the same seed, and other ones for another seed."""
    def build(seed):
        return load_dataset(_cfg(data="synthetic", src_len=16, tgt_len=5, seed=seed), SEQ2SEQ, TOK, 384)

    first, again, other = build(0), build(0), build(1)
    assert first is not again and first.examples is not again.examples
    picks = [0, 3, 12345, len(first) - 1]
    assert [first.examples[i] for i in picks] == [again.examples[i] for i in picks]
    assert all(first.examples[i] != other.examples[i] for i in picks)
    assert all(len(first.examples[i].input_ids) == 16 and len(first.examples[i].labels) == 5 for i in picks)
    assert load_dataset(_cfg(data="synthetic"), SEQ2SEQ, TOK, 384, split="eval") is None


def test_the_shuffled_order_is_a_function_of_the_seed():
    """Fresh streams over fresh dataset objects: the same seed gives the same batches, another seed others."""
    def first_batches(seed, n=3):
        stream = batches(load_dataset(_cfg(), SEQ2SEQ, TOK, 384), 4, seed=seed, pad_id=0)
        return [next(stream)[2]["input_ids"] for _ in range(n)]

    one, same, other = first_batches(1), first_batches(1), first_batches(2)
    assert all(a.equal(b) for a, b in zip(one, same, strict=True))
    assert not any(a.shape == b.shape and a.equal(b) for a, b in zip(one, other, strict=True))
