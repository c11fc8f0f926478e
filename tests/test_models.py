"""Model loading: shipped configs for --from-scratch, from_pretrained for dirs, clear errors otherwise."""

import pytest
from transformers import ByT5Tokenizer

from fitone.errors import ModelError
from fitone.models import CAUSAL, SEQ2SEQ, build_model, load_config, load_model, shipped_models, task_of


def test_shipped_architectures():
    for name in ("t5-small", "t5-base", "t5-large", "t5-3b", "t5-11b", "gpt2", "gpt2-xl", "llama-7b"):
        assert name in shipped_models()


@pytest.mark.parametrize("name,task,billions", [("t5-3b", SEQ2SEQ, 2.85), ("gpt2-xl", CAUSAL, 1.56),
                                                ("llama-7b", CAUSAL, 6.74), ("t5-11b", SEQ2SEQ, 11.3)])
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


def test_local_dir_loads_weights_and_tokenizer(tiny_t5_dir):
    loaded = load_model(str(tiny_t5_dir), from_scratch=False)
    assert loaded.task == SEQ2SEQ and isinstance(loaded.tokenizer, ByT5Tokenizer)
    built = build_model(load_config("t5-tiny", from_scratch=True), meta=True)
    assert loaded.n_params == sum(p.numel() for p in built.parameters())


def test_from_scratch_tokenizer_is_byt5_and_pad_is_set():
    loaded = load_model("gpt2-tiny", from_scratch=True)
    assert isinstance(loaded.tokenizer, ByT5Tokenizer) and loaded.tokenizer.pad_token_id is not None
