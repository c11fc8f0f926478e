"""TrainConfig validation and size parsing: user mistakes become one clear ConfigError."""

import pytest

from fitone.config import TrainConfig
from fitone.errors import ConfigError
from fitone.units import parse_size


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("23.5 gib", int(23.5 * 2**30)), ("512MiB", 512 * 2**20),
    ("1000", 1000), (2048, 2048),
])
def test_parse_size_means_what_it_says(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24 parsecs", "lots", "-3GiB", "0", "GiB"])
def test_parse_size_rejects_nonsense_naming_the_format(text):
    with pytest.raises(ConfigError, match="24GiB|positive"):
        parse_size(text)


@pytest.mark.parametrize("field,value,fragment", [
    ("src_len", 0, "--src-len must be a positive"), ("tgt_len", -5, "--tgt-len"), ("seq_len", 0, "--seq-len"),
    ("batch_size", 0, "--batch-size"), ("batch_size", "many", "--batch-size"), ("precision", "fp8", "fp16, bf16, fp32"),
    ("offload", "nvme", "cpu, none"), ("lr", 0, "--lr"), ("max_gpu_memory", "24 bananas", "24GiB"),
    ("ds_config", "/no/such.json", "no such file"), ("max_steps", 0, "--max-steps"),
])
def test_invalid_values_name_the_option(field, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig(model="t5-tiny", **{field: value})


def test_conflicting_options():
    with pytest.raises(ConfigError, match="not both"):
        TrainConfig(grad_accum=2, global_batch=64)
    with pytest.raises(ConfigError, match="not both"):
        TrainConfig(resume=True, overwrite=True)


def test_unknown_key_names_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        TrainConfig.from_dict({"batch_sise": 4})


def test_batch_size_text_digits_become_int_and_auto_stays():
    assert TrainConfig(batch_size="16").batch_size == 16
    assert TrainConfig(batch_size="auto").batch_size == "auto"


def test_accumulation_from_global_batch():
    cfg = TrainConfig(global_batch=64)
    assert cfg.accumulation(8) == 8
    assert cfg.accumulation(8, world_size=2) == 4
    with pytest.raises(ConfigError, match="not a multiple"):
        cfg.accumulation(24)
    assert TrainConfig(grad_accum=3).accumulation(8) == 3


def test_host_memory_thresholds_must_be_ordered_fractions():
    with pytest.raises(ConfigError, match="--host-mem-warn <= --host-mem-stop"):
        TrainConfig(host_mem_warn=0.96, host_mem_stop=0.9)
    with pytest.raises(ConfigError, match="--host-mem-warn"):
        TrainConfig(host_mem_stop=1.5)
    with pytest.raises(ConfigError, match="--max-bad-steps"):
        TrainConfig(max_bad_steps=0)
