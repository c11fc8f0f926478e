"""Model loading: shipped configs for --from-scratch, from_pretrained for dirs, clear errors otherwise.

A user's own directories come from tests/user_models.py (17 architectures, each with its own BPE tokenizer,
BOS-adding or not); what is not a language model (BERT, a classifier, ViT, a base model) and a multimodal
Gemma 3 are saved here with save_pretrained, tiny and random, as a user's directory would hold them.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer

import user_models
from conftest import run_main
from fitone.errors import ModelError
from fitone.models import (CAUSAL, SEQ2SEQ, build_model, load_config, load_model, load_tokenizer, shipped_models,
                           task_of)
from fitone.plan import plan
from fitone.random_init import build_random_model

PLAN = dict(gpu_mem="24GiB", host_mem="64GiB")
RUN = ["--device", "cpu", "--precision", "fp32", "--eval-examples", "0", "--no-progress"]
TRAIN = ["--seq-len", "16", "--batch-size", "2", "--max-steps", "2", *RUN]


@pytest.fixture(scope="module")
def user_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user-models")
    return {arch: user_models.model_dir(arch, root / arch, bos=user_models.family_bos(arch))
            for arch in user_models.ARCHITECTURES}


def one_error_line(argv: list[str]) -> str:
    rc, _, err = run_main(argv)
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fitone:")]
    assert len(lines) == 1, err
    return lines[0]


def test_shipped_architectures():
    for name in ("t5-small", "t5-base", "t5-large", "t5-3b", "t5-11b", "gpt2", "gpt2-xl", "llama-7b"):
        assert name in shipped_models()


@pytest.mark.parametrize("name,task,billions", [("t5-3b", SEQ2SEQ, 2.85), ("gpt2-xl", CAUSAL, 1.56),
                                                ("llama-7b", CAUSAL, 6.74), ("t5-11b", SEQ2SEQ, 11.3),
                                                ("llama-2-13b", CAUSAL, 13.02)])
def test_meta_build_counts_published_parameters(name, task, billions):
    config = load_config(name, from_scratch=True)
    assert task_of(config) == task
    model = build_model(config, meta=True)  # no memory: the meta device
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e9 == pytest.approx(billions, rel=0.02)


def test_unknown_model_errors_suggest_the_fix():
    with pytest.raises(ModelError, match="local path.*--from-scratch"):
        load_model("t5-3b", from_scratch=False)  # offline, not cached
    with pytest.raises(ModelError, match="no shipped config named 't5-4b'"):
        load_model("t5-4b", from_scratch=True)
    with pytest.raises(ModelError, match="local directory"):
        load_model("./no/such/dir", from_scratch=False)


def test_a_hub_model_not_on_this_machine_names_its_shipped_architecture():
    """The llama-7b recipe's model is a hub id, not a shipped name: offline, training it says how to build
    the architecture instead, in flags and in the recipe's words; the plan plans that architecture."""
    with pytest.raises(ModelError, match=re.escape("--model llama-7b --from-scratch (in a recipe: "
                                                   "model=llama-7b from_scratch=true)")):
        load_config("meta-llama/Llama-2-7b-hf", from_scratch=False)
    p = plan(model="meta-llama/Llama-2-7b-hf", **PLAN)
    assert p.n_params / 1e9 == pytest.approx(6.74, rel=0.01)
    assert any("shipped llama-7b config" in n and "model=llama-7b from_scratch=true" in n for n in p.notes)
    rc, out, _ = run_main(["plan", "--recipe", "llama-7b/24gb", "--gpu-mem", "24GiB", "--host-mem", "256GiB"])
    assert rc == 0 and "6.74B params" in out


def test_local_dir_loads_weights_and_tokenizer(tiny_t5_dir):
    loaded = load_model(str(tiny_t5_dir), from_scratch=False)
    assert loaded.task == SEQ2SEQ and isinstance(loaded.tokenizer, ByT5Tokenizer)
    built = build_model(load_config("t5-tiny", from_scratch=True), meta=True)
    assert loaded.n_params == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_a_from_scratch_model_is_built_in_the_asked_dtype_with_its_own_init_and_seed(name):
    """What a GPU run asks (`device`, the engine's 16-bit dtype), asked here of the CPU: every weight in that
    dtype, the same weights for a seed, and the architecture's own init: the fp32 build's statistics."""
    def weights(seed: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        model = load_model(name, from_scratch=True, seed=seed, device="cpu", dtype=dtype).model
        return {k: v.detach() for k, v in model.named_parameters()}

    half, again, other, full = (weights(0, torch.bfloat16), weights(0, torch.bfloat16), weights(1, torch.bfloat16),
                                weights(0, None))
    assert {v.dtype for v in half.values()} == {torch.bfloat16} and {v.dtype for v in full.values()} == {torch.float32}
    assert all(torch.equal(half[k], again[k]) for k in half)
    assert not any(torch.equal(half[k], other[k]) for k in half if half[k].dim() >= 2)
    for k, v in full.items():  # norms at 1, biases at 0, matrices at the config's std (T5 scales its own)
        if v.dim() < 2 or (v == v.flatten()[0]).all():
            assert torch.equal(half[k].float(), v), k
        else:
            assert half[k].float().std().item() == pytest.approx(v.std().item(), rel=0.1), k


def test_from_scratch_tokenizer_is_byt5_and_pad_is_set():
    loaded = load_model("gpt2-tiny", from_scratch=True)
    assert isinstance(loaded.tokenizer, ByT5Tokenizer) and loaded.tokenizer.pad_token_id is not None


# -- a user's own models --------------------------------------------------------------------------------
def test_every_user_architecture_loads_as_saved_with_its_own_tokenizer(user_dirs):
    """Each of the 17: the class its config names, the task that follows, no weight added or left out, and the
    directory's own tokenizer (BOS-adding or not), never the byte tokenizer."""
    for arch, path in user_dirs.items():
        loaded = load_model(str(path), from_scratch=False)
        assert type(loaded.model).__name__ == loaded.config.architectures[0], arch
        assert loaded.task == (SEQ2SEQ if arch in user_models.SEQ2SEQ else CAUSAL), arch
        assert loaded.notes == [], (arch, loaded.notes)
        own = AutoTokenizer.from_pretrained(path)
        assert not isinstance(loaded.tokenizer, ByT5Tokenizer), arch
        ids = loaded.tokenizer("hello world")["input_ids"]
        assert ids == own("hello world")["input_ids"], arch
        assert (ids[0] == own.convert_tokens_to_ids("<s>")) == (own.bos_token is not None), arch


def test_an_lm_named_as_transformers_no_longer_names_it_loads_by_its_model_type(tiny_t5_dir, tmp_path):
    """The hub's t5-small..t5-11b config.json files say T5WithLMHeadModel, a class transformers 5 lacks."""
    shutil.copytree(tiny_t5_dir, tmp_path / "t5", dirs_exist_ok=True)
    config = json.loads((tmp_path / "t5" / "config.json").read_text())
    (tmp_path / "t5" / "config.json").write_text(json.dumps({**config, "architectures": ["T5WithLMHeadModel"]}))
    loaded = load_model(str(tmp_path / "t5"), from_scratch=False)
    assert loaded.task == SEQ2SEQ and loaded.notes == []


@pytest.mark.parametrize("arch, how", [("llama3", "no files"), ("qwen2", "truncated"), ("t5-v1_1", "no files")])
def test_a_user_model_without_a_readable_tokenizer_is_refused_in_one_line(user_dirs, tmp_path, text_jsonl,
                                                                          arch, how):
    """No tokenizer files, or a tokenizer.json cut short (its JSONDecodeError is a ValueError): one line, exit 2,
    before anything is written. Before, both trained with the ByT5 byte tokenizer, exit 0."""
    path = tmp_path / arch
    shutil.copytree(user_dirs[arch], path)
    if how == "no files":
        for f in path.glob("tokenizer*"):
            f.unlink()
    else:
        text = (path / "tokenizer.json").read_text()
        (path / "tokenizer.json").write_text(text[: len(text) // 2])
    data = "sample" if arch in user_models.SEQ2SEQ else str(text_jsonl)
    lengths = ["--src-len", "16", "--tgt-len", "16"] if arch in user_models.SEQ2SEQ else ["--seq-len", "16"]
    out = tmp_path / "run"
    line = one_error_line(["train", "--model", str(path), "--data", data, *lengths, "--batch-size", "2",
                           "--max-steps", "2", *RUN, "--out", str(out)])
    assert f"tokenizer.save_pretrained('{path}')" in line, line
    assert ("JSONDecodeError" in line) == (how == "truncated"), line
    assert not out.exists()
    # the byte tokenizer stays for an architecture built from scratch
    config = load_config(str(path), from_scratch=True)
    if how == "no files":
        assert isinstance(load_tokenizer(str(path), config, from_scratch=True), ByT5Tokenizer)


@pytest.fixture(scope="module")
def not_lm_dirs(tmp_path_factory) -> dict[str, Path]:
    """Directories of models that are not language models with an LM head, saved as a user's would be."""
    from transformers import (BertConfig, BertForMaskedLM, BertLMHeadModel, LlamaForSequenceClassification,
                              ViTConfig, ViTModel)

    root = tmp_path_factory.mktemp("not-lms")
    bert = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=256)
    dirs = {}
    for name, make in [
        ("bert-masked-lm", lambda n: BertForMaskedLM(BertConfig(vocab_size=n, **bert))),
        ("bert-lm-head", lambda n: BertLMHeadModel(BertConfig(vocab_size=n, **bert))),  # is_decoder=False
        ("llama-classifier", lambda n: LlamaForSequenceClassification(user_models.model_config("llama3", n))),
    ]:
        tok = user_models.tokenizer(root / name, bos=name.startswith("llama"))
        make(len(tok)).save_pretrained(root / name)
        dirs[name] = root / name
    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=28, patch_size=14)).save_pretrained(root / "vit")
    dirs["vit"] = root / "vit"
    return dirs


@pytest.mark.parametrize("name, words", [
    ("bert-masked-lm", "encoder-only model (BertForMaskedLM)"),
    ("bert-lm-head", "encoder-only model (BertLMHeadModel)"),  # before: a "causal" LM that sees the future
    ("llama-classifier", "its sequence-classification head would be dropped"),  # before: score.weight dropped
    ("vit", "'vit' model (ViTModel), not a language model"),  # before: a traceback
])
def test_what_is_not_a_language_model_is_refused_in_one_line(not_lm_dirs, text_jsonl, tmp_path, name, words):
    path = str(not_lm_dirs[name])
    assert words in one_error_line(["plan", "--model", path, "--gpu-mem", "24GiB", "--host-mem", "64GiB"])
    for extra in ([], ["--no-preflight"]):  # --no-preflight said the ViT directory had no config.json
        line = one_error_line(["train", "--model", path, "--data", str(text_jsonl), *TRAIN, *extra,
                               "--out", str(tmp_path / "run")])
        assert words in line and "config.json" not in line, line
    assert not (tmp_path / "run").exists()


def test_a_base_model_gets_an_lm_head_and_says_so(tmp_path):
    """A LlamaModel directory (no head): its body loads, a random lm_head is added, and plan and load say so."""
    from transformers import LlamaModel

    tok = user_models.tokenizer(tmp_path, bos=True)
    torch.manual_seed(0)
    base = LlamaModel(user_models.model_config("llama3", len(tok)))
    base.save_pretrained(tmp_path)
    p = plan(model=str(tmp_path), **PLAN)
    assert any("base LlamaModel without an LM head" in n and "random" in n for n in p.notes), p.notes
    loaded = load_model(str(tmp_path), from_scratch=False)
    assert loaded.notes == [f"1 weights of LlamaForCausalLM are not in {tmp_path} and start from random values: "
                            "lm_head.weight"]
    assert torch.equal(loaded.model.model.embed_tokens.weight, base.embed_tokens.weight)
    assert loaded.n_params == p.n_params


# -- a multimodal Gemma 3 --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory) -> Path:
    """A Gemma3ForConditionalGeneration (the 4B/12B/27B kind: sizes under text_config, a vision tower)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = tmp_path_factory.mktemp("models") / "gemma3-mm"
    tok = user_models.tokenizer(path, bos=True)
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=len(tok) + 3, max_position_embeddings=256)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=len(tok),
        boi_token_index=len(tok) + 1, eoi_token_index=len(tok) + 2)).save_pretrained(path)
    return path


def test_gemma3_multimodal_trains_its_text_part_with_the_full_models_logits(gemma3_multimodal):
    """Before: plan/shape.py crashed on int(None), then load_tokenizer did. Now its text part is planned,
    loaded and trained as Gemma3ForCausalLM; on text its logits are the full model's, to the bit."""
    path = str(gemma3_multimodal)
    p = plan(model=path, **PLAN)
    assert any("multimodal (Gemma3ForConditionalGeneration)" in n and "vision tower" in n for n in p.notes)
    loaded = load_model(path, from_scratch=False)
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM" and loaded.task == CAUSAL
    assert loaded.n_params == p.n_params
    assert len(loaded.notes) == 1 and "left out" in loaded.notes[0] and "vision_tower" in loaded.notes[0]
    full = AutoModelForCausalLM.from_pretrained(path).eval()
    assert loaded.n_params < sum(x.numel() for x in full.parameters())
    ids = loaded.tokenizer(["the quick brown fox", "hello world"], padding=True, return_tensors="pt")
    with torch.no_grad():
        mine = loaded.model.eval()(**ids).logits
        theirs = full(**ids).logits
    assert torch.equal(mine, theirs)


def test_gemma3_multimodal_text_part_trains_and_exports_a_text_model(gemma3_multimodal, text_jsonl, tmp_path):
    out = tmp_path / "run"
    rc, said, err = run_main(["train", "--model", str(gemma3_multimodal), "--data", str(text_jsonl), "--seq-len",
                              "16", "--batch-size", "4", "--max-steps", "12", "--lr", "3e-3", *RUN, "--out", str(out)])
    assert rc == 0, err[-2000:]
    assert "left out of the run and of final/" in said
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) < sum(losses[:3])
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(final).__name__ == "Gemma3ForCausalLM"
    assert sum(x.numel() for x in final.parameters()) == plan(model=str(gemma3_multimodal), **PLAN).n_params


@pytest.mark.parametrize("arch", ["llama3-tied", "gemma2", "opt", "qwen2_moe", "t5-v1_1", "bart"])
def test_a_random_model_is_made_on_its_device_in_its_dtype_seeded_with_its_ties(arch):
    """The probe's model: every parameter real, in the dtype asked for, tied ones once, the same per seed."""
    config = user_models.model_config(arch, vocab_size=320)
    model = build_random_model(config, "cpu", torch.bfloat16, seed=3)
    reference = build_model(config, meta=True)  # what the architecture ties and holds
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (reference.get_output_embeddings().weight is reference.get_input_embeddings().weight)
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:  # N(0, std): checked on the embedding below (20k values: within 10%)
                continue
            assert torch.all(param == (0.0 if name == "bias" else 1.0)), (arch, name)
    embedding = model.get_input_embeddings().weight.float()
    assert abs(embedding.std().item() - std) < 0.1 * std and abs(embedding.mean().item()) < 0.1 * std

    same = build_random_model(config, "cpu", torch.float32, seed=3)
    again = build_random_model(config, "cpu", torch.float32, seed=3)
    other = build_random_model(config, "cpu", torch.float32, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(same.parameters(), again.parameters()))
    assert not torch.equal(same.get_input_embeddings().weight, other.get_input_embeddings().weight)
    ids = torch.tensor([[5, 6, 7, 8]])
    batch = {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        assert torch.isfinite(same(**batch).loss)
