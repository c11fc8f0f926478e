"""--pack trains exactly what fitone.packing says it does, and is refused, in one line, everywhere else.

For every causal architecture of tests/user_models.py (and the shipped gpt2, and Falcon with ALiBi, a
config switch the table refuses) under each attention implementation fitone runs (eager, sdpa: flash
attention needs a GPU and is not in the table), one tiny random-weight forward of a row packed by
fitone's own pack_examples and collate must give its second example the logits that example has alone,
to an fp32 rounding bound, exactly where the table lists the pair; where it does not, the gap must be
beyond that bound and fitone must refuse. The second example starts past position 256, so a bias that
rounds by absolute row position (bf16 holds integers exactly only up to 256) shows.
"""

from __future__ import annotations

import json

import pytest
import torch
import user_models
from conftest import run_main
from tolerance import fp32_logit_drift

from fitone import packing
from fitone.data import collate
from fitone.data.examples import ArrowExamples, Example
from fitone.data.tokens import pack_examples
from fitone.errors import ConfigError
from fitone.models import CAUSAL

ROW = 512  # tokens in the packed row, and the longest sum in these models (hidden <= 128, feed-forward <= 512)
FIRST, SECOND = 440, 56  # the two examples' lengths; the row's last 16 tokens are padding
ATTENTIONS = ("eager", "sdpa")
VOCAB = 320  # user_models' tokenizers
ARCHS = [*user_models.CAUSAL, "gpt2", "falcon-alibi"]


def _config(arch: str):
    if arch == "gpt2":
        from fitone.models import load_config

        return load_config("gpt2-tiny", from_scratch=True)  # 512 positions already
    config = user_models.model_config(arch.removesuffix("-alibi"), vocab_size=VOCAB)
    config.max_position_embeddings = ROW  # OPT's learned positions must hold the first example's
    if arch == "falcon-alibi":
        config.alibi = True
    return config


def _model(config, attention: str | None):
    from transformers import AutoModelForCausalLM

    config.use_cache = False  # as training sets it: with a KV cache transformers never looks for packed rows
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()


def _second_example_logits(model, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The second example's logits inside a packed row, and alone (a padded batch of one, as without --pack)."""
    import datasets

    g = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (FIRST, SECOND))
    table = datasets.Dataset.from_dict({"input_ids": [first, second], "labels": [first, second]})
    rows = ArrowExamples(pack_examples(table, ROW, pad_id=0, use_cache=False))
    assert len(rows) == 1 and rows[0].position_ids[FIRST] == 0  # both in one row; positions restart there
    packed = collate(list(rows), CAUSAL, pad_id=0)
    assert "attention_mask" not in packed
    with torch.no_grad():
        inside = model(**packed).logits[0, FIRST:FIRST + SECOND]
        alone = model(**collate([Example(second, second)], CAUSAL, pad_id=0)).logits[0]
    return inside, alone


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_table_says_whether_a_packed_row_gives_each_example_its_own_logits(arch, attention):
    config = _config(arch)
    try:
        model = _model(config, attention)
    except ValueError:  # transformers has no such implementation for this model, so no run gets it
        assert attention not in packing.EXACT.get(config.model_type, ())
        return
    assert model.config._attn_implementation == attention
    inside, alone = _second_example_logits(model, config.vocab_size)
    gap = float((inside - alone).abs().max())
    bound = fp32_logit_drift(alone, blocks=config.num_hidden_layers, terms=ROW)
    refusal = packing.pack_refusal(model.config)
    if refusal is None:
        assert gap <= bound, f"{arch} ({attention}): packed logits {gap:.3g} from alone, beyond {bound:.3g}"
    else:
        assert gap > bound, f"{arch} ({attention}) packs exactly ({gap:.3g} <= {bound:.3g}): list it in EXACT"
        with pytest.raises(ConfigError, match="drop --pack$") as refused:
            packing.require_exact_packing(model.config)
        assert "\n" not in str(refused.value)


def test_every_entry_of_the_table_is_one_these_tests_run():
    tested = {_config(arch).model_type for arch in ARCHS}
    assert set(packing.EXACT) <= tested and set(packing.LEAKS) <= tested
    assert all(all(a in ATTENTIONS for a in attentions) for attentions in packing.EXACT.values())
    assert set(packing.SWITCHES) == {("falcon", "alibi")}  # the falcon-alibi case above


@pytest.mark.parametrize("arch", ARCHS)
def test_the_attention_fitone_checks_is_the_one_transformers_loads(arch):
    config = _config(arch)
    assert packing.attention_of(config) == _model(config, None).config._attn_implementation


def test_flash_attention_is_refused_until_proven():
    config = _config("llama3")
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="not proven exact for llama with flash_attention_2 attention.*drop --pack$"):
        packing.require_exact_packing(config)


# -- through the CLI: a user's own model directory ----------------------------------------------------
@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    return user_models.model_dir("opt", tmp_path_factory.mktemp("models") / "opt", bos=True)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "texts.jsonl"
    words = ["the quick brown fox", "hello world", "nine hundred ninety-nine", "question: answer:"]
    path.write_text("".join(json.dumps({"text": " ".join(words[(i + k) % 4] for k in range(1 + i % 3))}) + "\n"
                            for i in range(64)))
    return path


def test_train_plan_and_probe_refuse_pack_on_opt_in_one_line_before_any_weights(opt_dir, texts, tmp_path):
    out = tmp_path / "run"
    common = ["--model", str(opt_dir), "--seq-len", "64", "--pack", "--device", "cpu"]
    rc, _, err = run_main(["train", *common, "--data", str(texts), "--out", str(out), "--batch-size", "2",
                           "--max-steps", "2", "--precision", "fp32", "--no-progress"])
    assert rc == 2 and not out.exists()
    assert err.strip().splitlines() == ["fitone: error: --pack lets a packed row's examples see each other in opt: "
                                        f"{packing.LEAKS['opt']}; drop --pack"]
    for command in (["plan", *common, "--gpu-mem", "24GiB"], ["probe-batch", *common, "--max-batch", "4"]):
        rc, _, also = run_main(command)
        assert (rc, also) == (2, err), command
    rc, _, _ = run_main(["plan", *[f for f in common if f != "--pack"], "--gpu-mem", "24GiB"])
    assert rc == 0  # without --pack the same model plans


@pytest.mark.parametrize("arch, bos", [("llama3", True), ("qwen2", False)])
def test_pack_trains_a_users_own_model_that_packs_exactly(arch, bos, texts, tmp_path):
    import fitone
    from conftest import cpu_config

    model = user_models.model_dir(arch, tmp_path / arch, bos=bos)
    result = fitone.train(cpu_config(model=str(model), from_scratch=False, data=str(texts), seq_len=64, pack=True,
                                     batch_size=2, max_steps=12, lr=3e-3))
    head, tail = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert tail < 0.8 * head, result.losses
