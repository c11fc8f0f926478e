"""TrainConfig validation and size parsing: user mistakes become one clear ConfigError."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

import fitone
from fitone.config import DataSettings, GuardSettings, MemorySettings, RunDirSettings, ScheduleSettings, TrainConfig
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
    ("max_steps", 0, "--max-steps"),
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


SECTIONS = {"data_settings": DataSettings, "schedule_settings": ScheduleSettings,
            "memory_settings": MemorySettings, "run_dir_settings": RunDirSettings, "guard_settings": GuardSettings}


@pytest.mark.parametrize("method", SECTIONS)
def test_a_section_holds_the_settings_own_fields_and_values(method, tmp_path):
    own = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    section = getattr(TrainConfig(model="t5-tiny", seq_len=99, out=str(tmp_path), max_bad_steps=3), method)()
    assert type(section) is SECTIONS[method]
    for f in dataclasses.fields(section):
        assert own.get(f.name) == f.type, f"{f.name}: not a TrainConfig field of that type"
    cfg = TrainConfig(model="t5-tiny", seq_len=99, out=str(tmp_path), max_bad_steps=3)
    assert dataclasses.asdict(section) == {f.name: getattr(cfg, f.name) for f in dataclasses.fields(section)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(section, dataclasses.fields(section)[0].name, None)


def test_data_settings_are_what_data_reads():
    assert TrainConfig(data="x.jsonl", pack=True, seq_len=64).data_settings().seq_len == 64
    assert {"data", "pack", "seq_len", "src_len", "tgt_len", "eval_data", "chat_template"} <= {
        f.name for f in dataclasses.fields(DataSettings)}


def _files(tmp_path):
    ds, template = tmp_path / "ds.json", tmp_path / "chat.jinja"
    ds.write_text("{}")
    template.write_text("{{ messages }}")
    return ds, template


def test_replace_checks_values_but_reads_no_files(tmp_path, monkeypatch):
    ds, template = _files(tmp_path)
    cfg = TrainConfig(model="t5-tiny", ds_config=str(ds), chat_template=str(template), out=str(tmp_path),
                      report_to="tensorboard,wandb")
    read: list[str] = []  # recorded, not raised: pytest itself reads files while it reports
    for name in ("is_file", "exists", "stat"):
        spy = (lambda real: lambda self, *a, **k: read.append(str(self)) or real(self, *a, **k))(getattr(Path, name))
        monkeypatch.setattr(Path, name, spy)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: read.append(name) or real_find_spec(name, *a))
    changed = cfg.replace(lr=3e-4, batch_size=4)
    with pytest.raises(ConfigError, match="--lr must be positive"):
        cfg.replace(lr=0)  # the value checks still run on every replace
    monkeypatch.undo()
    assert changed.lr == 3e-4 and read == []


@pytest.mark.parametrize("field,fragment", [
    ("ds_config", r"^--ds-config /no/such\.json: no such file; give the path of a DeepSpeed JSON file$"),
    ("chat_template", r"^--chat-template /no/such\.json: no such file; give a Jinja chat template file$"),
])
def test_check_paths_refuses_a_missing_file_in_one_line(field, fragment):
    cfg = TrainConfig(model="t5-tiny", **{field: "/no/such.json"})  # building it reads no file
    with pytest.raises(ConfigError, match=fragment):
        cfg.check_paths()


def test_check_paths_refuses_wandb_when_it_is_not_installed(tmp_path, monkeypatch):
    cfg = TrainConfig(model="t5-tiny", out=str(tmp_path), report_to="tensorboard,wandb")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match="^--report-to wandb needs the wandb package: pip install wandb$"):
        cfg.check_paths()


def test_a_plan_checks_the_files_once_however_many_sizes_it_tries(tmp_path, monkeypatch):
    ds, template = _files(tmp_path)
    stats: list[str] = []
    real = Path.is_file

    def is_file(self):
        stats.append(str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    p = fitone.plan(model="t5-tiny", from_scratch=True, gpu_mem="24GiB", host_mem="64GiB", ds_config=str(ds),
                    chat_template=str(template), src_len=16, tgt_len=16)
    assert p.max_micro_batch is not None and p.max_micro_batch > 1  # its search tried several sizes
    assert stats.count(str(ds)) == 1 and stats.count(str(template)) == 1


@pytest.mark.parametrize("entry", ["plan", "probe_batch", "train"])
def test_every_entry_refuses_a_missing_file_before_any_work(entry):
    options = dict(model="t5-tiny", from_scratch=True, device="cpu", precision="fp32", ds_config="/no/such.json")
    extra = {"plan": {"gpu_mem": "24GiB"}, "probe_batch": {"max_batch": 2}, "train": {}}[entry]
    with pytest.raises(ConfigError, match=r"^--ds-config /no/such\.json: no such file"):
        getattr(fitone, entry)(**options, **extra)
