"""Built-in recipes: every file loads into a valid TrainConfig, its header's commands work, `fitone recipes`
lists/shows/copies them, overrides stack recipe < key=value < flags, and an installed wheel carries them."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import child_env
from fitone.cli import build_parser, main
from fitone.cli.options import config_from_args
from fitone.cli.train import TRAIN_FLAGS
from fitone.config import TrainConfig
from fitone.ds_config import build_ds_config
from fitone.run import resolve_planned
from fitone.errors import ConfigError
from fitone.models import shipped_models
from fitone.recipes import copy_recipe, list_recipes, load_recipe, parse_overrides, recipe_dir, recipe_names

REPO = Path(__file__).resolve().parent.parent
NAMES = recipe_names()
GPU_RECIPES = [n for n in NAMES if re.fullmatch(r"\d+gb", n.split("/")[1])]


def test_the_issue_s_recipes_exist():
    # the README's main job, the source blog's headline, and one per model x GPU class the issue asks for
    assert {"t5-tiny/cpu", "t5-3b/24gb", "t5-large/24gb", "t5-3b/80gb", "gpt2-xl/16gb", "llama-7b/24gb"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_builds_a_valid_config_and_deepspeed_config(name):
    recipe = load_recipe(name)
    cfg = recipe.config()
    assert isinstance(cfg, TrainConfig) and cfg.recipe == name
    assert recipe.path.parent.name in shipped_models()  # so `model=<folder> from_scratch=true` reproduces it offline
    micro = cfg.batch_size if isinstance(cfg.batch_size, int) else 1
    shipped = cfg.replace(model=recipe.path.parent.name, from_scratch=True)  # the same architecture, offline
    ds = build_ds_config(resolve_planned(shipped, 1).with_batch(micro))
    # the arithmetic the header comments: micro-batch x accumulation = samples per optimizer step
    assert ds["train_batch_size"] == micro * ds["gradient_accumulation_steps"]
    if cfg.global_batch:
        assert ds["train_batch_size"] == cfg.global_batch
    assert re.search(rf"\b{micro} (\w+ )?x {ds['gradient_accumulation_steps']} accumulation", recipe.path.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_every_header_says_how_to_run_it_and_what_was_measured(name):
    recipe = load_recipe(name)
    assert f"fitone train --recipe {name}" in recipe.header
    assert re.search(r"^# Measured:", recipe.header, re.M), "a `# Measured:` line (or 'not yet measured')"
    if recipe.measured is None:
        assert "not" in recipe._header_line("measured:").lower()  # says so instead of leaving it blank


@pytest.mark.parametrize("name", NAMES)
def test_every_command_in_a_header_parses_and_builds_its_config(name, capsys):
    """Header commands are copied by users: each must parse, and a train command must build its config."""
    commands = [line[4:].split("   #")[0] for line in load_recipe(name).header.splitlines()
                if line.startswith("#   fitone ")]
    assert commands
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)[1:]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: header command does not parse: {command}\n{capsys.readouterr().err}")
        if args.command == "train":
            config_from_args(args, TRAIN_FLAGS)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_fitone_plan_says_each_gpu_recipe_fits_its_gpu_class(name):
    from fitone.plan import DOES_NOT_FIT, FITS_ON_GPU, plan

    recipe = load_recipe(name)
    gpu_gib = int(recipe.gpu_class.removesuffix("gb"))
    # the shipped architecture of the folder's model (no hub); host RAM is the recipe header's concern
    cfg = recipe.config(model=recipe.path.parent.name, from_scratch=True)
    p = plan(cfg, gpu_mem=f"{gpu_gib}GiB", host_mem="1TiB")
    assert p.verdict != DOES_NOT_FIT and p.gpu_total <= p.gpu_limit, str(p)
    if cfg.offload == "none":
        assert p.verdict == FITS_ON_GPU
    assert p.max_micro_batch >= cfg.batch_size  # the recipe's batch is at or under the predicted limit


def test_numbers_in_exponent_form_are_numbers():
    # PyYAML (YAML 1.1) reads `1e-4` as a string; a recipe or key=value means the number
    assert parse_overrides(["lr=1e-4", "max_steps=2e3", "batch_size=auto", "max_gpu_memory=23GiB"]) == {
        "lr": 1e-4, "max_steps": 2000, "batch_size": "auto", "max_gpu_memory": "23GiB"}


def test_overrides_stack_recipe_then_key_value_then_flags():
    recipe = load_recipe("t5-3b/24gb").values

    def cfg(*argv: str) -> TrainConfig:
        return config_from_args(build_parser().parse_args(["train", "--recipe", "t5-3b/24gb", *argv]), TRAIN_FLAGS)

    plain = cfg()
    assert (plain.batch_size, plain.lr, plain.precision) == (recipe["batch_size"], recipe["lr"], recipe["precision"])
    over = cfg("batch_size=7", "lr=3e-4", "precision=bf16")
    assert (over.batch_size, over.lr, over.precision) == (7, 3e-4, "bf16")
    both = cfg("batch_size=7", "lr=3e-4", "--batch-size", "9", "--lr", "5e-5")
    assert (both.batch_size, both.lr, both.precision) == (9, 5e-5, recipe["precision"])


def test_recipes_lists_every_recipe_with_model_gpu_class_and_measurement(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for recipe in list_recipes():
        line = next(ln for ln in out.splitlines() if ln.startswith(recipe.name + " "))
        assert recipe.model in line and recipe.gpu_class in line
        assert (recipe.measured or "not measured") in line
    assert main(["recipes", "list"]) == 0 and capsys.readouterr().out == out


def test_recipes_list_tells_the_file_s_batch_from_the_measured_one(capsys):
    """t5-3b/24gb runs micro-batch 256; its header's 86.3 samples/s were measured at the 323 that
    batch_size=auto chose. The list gives both, each named for what it is."""
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header == ["NAME", "MODEL", "GPU", "BATCH", "MEASURED"]
    for recipe in list_recipes():
        line = next(ln for ln in lines if ln.startswith(recipe.name + " "))
        cfg = recipe.config()
        cells = line.split(None, 3)
        assert cells[3].startswith(f"{cfg.batch_size} x {cfg.accumulation(cfg.batch_size)}  "), line
    t5 = next(ln for ln in lines if ln.startswith("t5-3b/24gb "))
    assert re.search(r"\b256 x 1\s+at micro-batch 323 \(batch_size=auto\), 86\.3 samples/s$", t5), t5


def test_recipes_list_shows_measured_numbers_from_the_header(tmp_path, monkeypatch, capsys):
    (tmp_path / "t5-3b").mkdir()
    text = load_recipe("t5-3b/24gb").path.read_text()
    text = re.sub(r"^# Measured:.*$", "# Measured: micro-batch 256 found by the probe, 59.7 samples/s, peak GPU "
                  "18.3 GiB, host 63.4 GiB, NVIDIA H200 capped at 23 GiB, 2026-11-29", text, count=1, flags=re.M)
    (tmp_path / "t5-3b" / "24gb.yaml").write_text(text)
    monkeypatch.setattr("fitone.recipes.recipe_dir", lambda: tmp_path)
    assert main(["recipes"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("t5-3b/24gb"))
    assert "micro-batch 256, 59.7 samples/s" in line


def test_a_batch_size_saved_by_the_probe_shows_in_the_list(tmp_path, monkeypatch, capsys):
    from fitone.probe.results import ProbeResult
    from fitone.recipes import save_to_recipe

    shutil.copytree(recipe_dir() / "gpt2-xl", tmp_path / "gpt2-xl")
    monkeypatch.setattr("fitone.recipes.recipe_dir", lambda: tmp_path)
    probed = ProbeResult(trials=[], largest_fit=25, chosen=23, margin=0.05, granularity=1, verified=True,
                         best_throughput=None, cap_bytes=None, wall_s=1.0,
                         meta={"model": "gpt2-xl", "precision": "fp16", "seq_len": 512, "gpu": "Tesla T4",
                               "date": "2026-12-01T10:00:00"})
    save_to_recipe(probed, tmp_path / "gpt2-xl" / "16gb.yaml")
    assert load_recipe("gpt2-xl/16gb").config().batch_size == 23
    assert main(["recipes"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gpt2-xl/16gb"))
    assert "probed: batch_size 23 on Tesla T4" in line
    assert "23, global 32: not a multiple" in line  # listed all the same; `fitone train` says how to fix it


def test_recipes_show_prints_the_file(capsys):
    assert main(["recipes", "show", "gpt2-xl/16gb"]) == 0
    assert capsys.readouterr().out == load_recipe("gpt2-xl/16gb").path.read_text()


def test_recipes_copy_writes_an_editable_copy_and_never_overwrites(tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert main(["recipes", "copy", "t5-3b/24gb", str(dest)]) == 0
    assert dest.read_text() == load_recipe("t5-3b/24gb").path.read_text()
    dest.write_text(dest.read_text().replace("batch_size: 256", "batch_size: 12"))
    capsys.readouterr()
    assert main(["recipes", "copy", "t5-3b/24gb", str(dest)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert "batch_size: 12" in dest.read_text()  # the edit survived
    edited = load_recipe(str(dest))
    assert edited.config().batch_size == 12 and edited.name == str(dest)
    # into a directory: named <model>-<gpu-class>.yaml
    assert copy_recipe("t5-large/24gb", tmp_path) == tmp_path / "t5-large-24gb.yaml"
    with pytest.raises(ConfigError, match="no directory"):
        copy_recipe("t5-large/24gb", tmp_path / "missing" / "x.yaml")


def test_unknown_recipe_exits_2_with_a_suggestion(capsys):
    assert main(["train", "--recipe", "t5-3b/24g"]) == 2
    err = capsys.readouterr().err
    assert "no recipe named 't5-3b/24g'" in err and "did you mean 't5-3b/24gb'" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["recipes", "show", "gpt2-x/16gb"]) == 2
    assert "did you mean 'gpt2-xl/16gb'" in capsys.readouterr().err


def test_unknown_key_in_a_recipe_file_or_override_names_the_nearest(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(load_recipe("t5-tiny/cpu").path.read_text() + "bach_size: 4\n")
    assert main(["train", "--recipe", str(bad)]) == 2
    assert "unknown key 'bach_size'" in (err := capsys.readouterr().err) and "did you mean 'batch_size'" in err
    assert main(["train", "--recipe", "t5-tiny/cpu", "max_step=5"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err


def test_an_installed_wheel_carries_every_recipe(tmp_path):
    """Build a wheel from a copy of the sources, unpack it, and list recipes from it outside any checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / item, src / item)
    for folder in ("fitone", "recipes"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("fitone-*.whl")
    packed = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("fitone/_recipes/")}
    assert packed == {f"fitone/_recipes/{n}.yaml" for n in NAMES}

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import fitone, fitone.recipes as r; print(fitone.__file__); print(r.recipe_dir()); "
             "print(','.join(x.name for x in r.list_recipes()))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env=child_env(PYTHONPATH=str(site)))
    assert run.returncode == 0, run.stderr
    module_file, found_dir, names = run.stdout.strip().splitlines()[-3:]
    assert Path(module_file).is_relative_to(site)  # imported from the wheel, not this checkout
    assert Path(found_dir) == site / "fitone" / "_recipes"
    assert names.split(",") == NAMES


def test_recipe_dir_is_this_checkout_s_folder():
    assert recipe_dir() == REPO / "recipes"


def test_the_optimizer_step_is_auto_unless_a_flag_or_key_says_otherwise():
    def cfg(*argv: str) -> TrainConfig:
        return config_from_args(build_parser().parse_args(["train", "--recipe", "t5-3b/24gb", *argv]), TRAIN_FLAGS)

    assert cfg().pipelined_update is None  # decided per run: zero2.step_mode
    assert cfg("--no-pipelined-update").pipelined_update is False
    assert cfg("--pipelined-update").pipelined_update is True
    assert cfg("pipelined_update=false").pipelined_update is False
    assert cfg("pipelined_update=auto").pipelined_update is None


def test_a_recipe_s_gpu_adam_share_gives_way_to_options_that_take_another_step(capsys):
    """llama-7b/24gb sets gpu_adam_share for its fp32 pipelined Adam: `--optimizer-states bf16` (the README's
    way to a smaller host) or another step trains without it and says so; a typed share is still refused."""
    def cfg(*argv: str) -> TrainConfig:
        return config_from_args(build_parser().parse_args(["train", "--recipe", "llama-7b/24gb", *argv]), TRAIN_FLAGS)

    share = load_recipe("llama-7b/24gb").values["gpu_adam_share"]
    assert share > 0 and cfg().gpu_adam_share == share and capsys.readouterr().out == ""
    for argv in (["--optimizer-states", "bf16"], ["--no-pipelined-update"], ["--delayed-update"],
                 ["--offload", "none"], ["pipelined_update=false"]):
        built = cfg(*argv)
        assert built.gpu_adam_share == 0.0 and not built.takes_gpu_adam_share(), argv
        assert "training without it" in capsys.readouterr().out, argv
    with pytest.raises(ConfigError, match="--gpu-adam-share shares"):
        cfg("--optimizer-states", "bf16", "--gpu-adam-share", str(share))
    with pytest.raises(ConfigError, match="--gpu-adam-share shares"):  # a typed share, however its key is spelled
        load_recipe("llama-7b/24gb").config(**{"optimizer-states": "bf16", "gpu-adam-share": share})
    assert main(["plan", "--recipe", "llama-7b/24gb", "--optimizer-states", "bf16", "--gpu-mem", "24GiB"]) == 0


def test_a_recipe_s_gpu_adam_share_off_its_one_gpu_is_said_once_by_rank_0(monkeypatch, capsys):
    """On the CPU (no GPU to share with) the run says in one line that the CPU steps every chunk; under a
    launcher the recipe's lines are said by rank 0 only (fitone.notice)."""
    from fitone.run import resolve

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1", DS_ACCELERATOR="cpu").items():
        monkeypatch.setenv(key, value)
    run = resolve(load_recipe("llama-7b/24gb").config(model="llama-7b", device="cpu", from_scratch=True,
                                                      max_gpu_memory=None))
    out = capsys.readouterr().out
    assert run.settings.gpu_adam_share > 0 and run.mode.gpu_share == 0.0
    assert out.count("gpu_adam_share") == 1 and "on the CPU the CPU steps every chunk" in out, out
    monkeypatch.setenv("RANK", "1")
    assert load_recipe("llama-7b/24gb").config(optimizer_states="bf16").gpu_adam_share == 0.0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    load_recipe("llama-7b/24gb").config(optimizer_states="bf16")
    assert "training without it" in capsys.readouterr().out
