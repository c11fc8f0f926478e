"""Bad input through `fitone train`: one line naming the fix, exit code 2, no traceback, nothing written.

Every case goes through `fitone.cli.main` (what the console script runs); two also through a real
`python -m fitone` process. The checks run before any weights load or engine is built, so these are fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, run_main
from fitone.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]

# a fast CPU run of the tiny T5 for bad-input cases; a value of None drops the flag
BASE = {"--model": "t5-tiny", "--from-scratch": True, "--device": "cpu", "--precision": "fp32", "--src-len": "8",
        "--tgt-len": "48", "--batch-size": "4", "--max-steps": "2", "--eval-examples": "0", "--no-progress": True}


def train_argv(**flags) -> list[str]:
    """`train` argv from BASE plus flags given as src_len="8" (True: a bare switch, None: left out)."""
    values = {**BASE, **{"--" + k.replace("_", "-"): v for k, v in flags.items()}}
    argv = ["train"]
    for flag, value in values.items():
        if value is True:
            argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def assert_one_line_error(err: str, pattern: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fitone: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Data and config files, good and bad."""
    d = tmp_path_factory.mktemp("inputs")
    good_row = json.dumps({"source": "12", "target": "twelve"})
    texts = {
        "empty": "\n\n",
        "malformed": f"{good_row}\n{good_row}\n{{\"source\": \"1\", \"target\": \n",
        "missing_field": f"{good_row}\n" + json.dumps({"source": "1", "label": "one"}) + "\n",
        "non_text": f"{good_row}\n" + json.dumps({"source": "1", "target": ["o", "n", "e"]}) + "\n",
        "few": f"{good_row}\n{good_row}\n",
        "ds_not_json": "{ \"zero_optimization\": { stage: 2 } }",
        "ds_unknown_top": json.dumps({"zero_optimisation": {"stage": 2}}),
        "ds_unknown_zero": json.dumps({"zero_optimization": {"reduce_bucket_sise": 1000}}),
        "ds_torch_adam": json.dumps({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}),
    }
    paths = {}
    for name, text in texts.items():
        paths[name] = d / (name + (".json" if name.startswith("ds_") else ".jsonl"))
        paths[name].write_text(text)
    paths["binary"] = d / "binary.jsonl"
    paths["binary"].write_bytes(b"\xff\xfe\x00\x01")
    paths["directory"] = d / "a-directory.jsonl"
    paths["directory"].mkdir()
    long_rows = [{"source": str(i) * (1 if i % 4 else 12), "target": "x"} for i in range(40)]  # 10 too long
    paths["long"] = d / "long.jsonl"
    paths["long"].write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    paths["text"] = d / "text.jsonl"
    paths["text"].write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20)))
    return paths


# (case id, flags over BASE, pattern the one line must match)
BAD_INPUT = [
    ("missing data file", {"data": "{d}/nope.jsonl"}, r"nope\.jsonl does not exist"),
    ("data is a directory", {"data": "{directory}"}, r"is a directory: give a JSONL file"),
    ("data not UTF-8", {"data": "{binary}"}, r"binary\.jsonl is not UTF-8"),
    ("empty data", {"data": "{empty}"}, r"empty\.jsonl holds no examples"),
    ("malformed line", {"data": "{malformed}"}, r"malformed\.jsonl:3: not valid JSON"),
    ("missing field", {"data": "{missing_field}"},
     r"missing_field\.jsonl: example 2: missing field 'target'.*--target-field"),
    ("non-text field", {"data": "{non_text}"}, r"non_text\.jsonl: example 2: field 'target' must be text, got list"),
    ("fewer examples than a batch", {"data": "{few}"}, r"has 2 examples, fewer than one step's 4.*--batch-size"),
    ("missing eval file", {"eval_data": "{d}/held-out.jsonl", "eval_examples": "8"},
     r"--eval-data file .*held-out\.jsonl does not exist: give the path of a \.jsonl/\.json, \.csv or \.parquet file, "
     r"a glob of them or a save_to_disk directory$"),
    ("malformed eval line", {"eval_data": "{malformed}", "eval_examples": "8"}, r"malformed\.jsonl:3: not valid JSON"),
    ("empty eval file", {"eval_data": "{empty}", "eval_examples": "8"}, r"^fitone: error: --eval-data file .*empty"),
    ("eval file with nothing to score", {"eval_data": "{text}"}, r"--eval-data is scored on --eval-examples .*above 0"),
    ("eval-every without held-out data", {"data": "{long}", "eval_every": "5", "eval_examples": "8"},
     r"--eval-every needs held-out data .*: add --eval-data FILE\.jsonl"),
    ("eval-every with nothing to score", {"eval_every": "5"}, r"--eval-every scores .*--eval-examples above 0"),
    ("eval-every 0", {"eval_every": "0", "eval_examples": "8"}, r"--eval-every must be a positive whole number"),
    ("prompt field on a seq2seq model", {"prompt_field": "question"},
     r"--prompt-field is for causal LMs; t5-tiny is seq2seq: its input is --source-field"),
    ("sample task with a causal LM", {"model": "gpt2-tiny"}, r"sample task is seq2seq"),
    ("unknown shipped model", {"model": "t5-huge"}, r"no shipped config named 't5-huge'.*t5-tiny"),
    ("unknown model path", {"model": "{d}/no-such-model", "from_scratch": None},
     r"cannot load local directory .*no-such-model.*save_pretrained"),
    ("unknown recipe", {"recipe": "t5-tiny/gpu-of-dreams"}, r"no recipe named 't5-tiny/gpu-of-dreams'"),
    ("unparsable memory size", {"max_gpu_memory": "24XB"}, r"cannot read --max-gpu-memory '24XB'.*24GiB"),
    ("batch size 0", {"batch_size": "0"}, r"--batch-size must be a positive whole number"),
    ("negative batch size", {"batch_size": "-4"}, r"--batch-size must be a positive whole number"),
    ("source length 0", {"src_len": "0"}, r"--src-len must be a positive whole number"),
    ("negative target length", {"tgt_len": "-1"}, r"--tgt-len must be a positive whole number"),
    ("max bad steps 0", {"max_bad_steps": "0"}, r"--max-bad-steps must be a positive whole number"),
    ("global batch not divisible", {"batch_size": "3", "global_batch": "10"},
     r"--global-batch 10 is not a multiple of .* 3: use --global-batch 9"),
    ("accumulation given twice", {"grad_accum": "2", "global_batch": "8"}, r"--grad-accum or --global-batch"),
    ("ds-config not JSON", {"ds_config": "{ds_not_json}"}, r"ds_not_json\.json is not valid JSON \(line 1"),
    ("ds-config missing", {"ds_config": "{d}/nope.json"}, r"--ds-config .*nope\.json: no such file"),
    ("ds-config unknown key", {"ds_config": "{ds_unknown_top}"},
     r"unknown key 'zero_optimisation'.*did you mean 'zero_optimization'"),
    ("ds-config unknown zero key", {"ds_config": "{ds_unknown_zero}"},
     r"unknown key 'reduce_bucket_sise' in zero_optimization.*'reduce_bucket_size'"),
    ("pipelined update on torch.optim's Adam", {"ds_config": "{ds_torch_adam}", "pipelined_update": True},
     r"--pipelined-update runs DeepSpeedCPUAdam's Adam/AdamW: drop .*torch_adam"),
    ("resume with nothing to resume", {"resume": True}, r"nothing to resume in .*drop --resume"),
    ("resume and overwrite", {"resume": True, "overwrite": True}, r"--resume or --overwrite, not both"),
    ("seq-len beyond positions", {"model": "gpt2-tiny", "data": "{text}", "seq_len": "4096"},
     r"--seq-len 4096 is beyond gpt2-tiny's 512 positions: use --seq-len 512"),
    ("fp16 on the CPU", {"precision": "fp16"}, r"fp16 needs a CUDA GPU.*--precision bf16 or fp32"),
    ("GPU cap on the CPU", {"max_gpu_memory": "8GiB"}, r"--max-gpu-memory caps a GPU.*drop it"),
]


@pytest.mark.parametrize("flags,pattern", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(files, tmp_path, flags, pattern):
    names = {k: str(v) for k, v in files.items()} | {"d": str(tmp_path)}
    out = tmp_path / "run"
    flags = {k: v.format(**names) if isinstance(v, str) else v for k, v in flags.items()}
    rc, _stdout, err = run_main(train_argv(out=out, **flags))
    assert rc == 2
    assert_one_line_error(err, pattern)
    assert not out.exists()


def test_unreadable_data_file(files, tmp_path, monkeypatch):
    """A --data file this process may not read. chmod 000 makes it so for a user; root reads it anyway
    (CAP_DAC_OVERRIDE), so as root the refusal the kernel gives a user is faked: opening this one file
    raises the PermissionError a user's open() gets."""
    import builtins
    import io

    path = tmp_path / "locked.jsonl"
    path.write_text(files["few"].read_text())
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = io.open

        def refusing_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file) == path:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(io, "open", refusing_open)  # what pathlib calls
        monkeypatch.setattr(builtins, "open", refusing_open)
    rc, _, err = run_main(train_argv(data=path, out=tmp_path / "run"))
    assert rc == 2
    assert_one_line_error(err, r"cannot read --data file .*locked\.jsonl.*permissions")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,pattern", [
    (["train", "--model", "t5-tiny", "--batch-sise", "4"], r"unrecognized arguments: --batch-sise"),
    (["train", "--model", "t5-tiny", "--precision", "fp8"], r"invalid choice: 'fp8'"),
    (["train", "--model", "t5-tiny", "--src-len", "long"], r"invalid int value: 'long'"),
])
def test_argparse_errors_exit_2_with_usage(argv, pattern, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fitone") and re.search(pattern, err) and "Traceback" not in err


@pytest.fixture(scope="module")
def finished_run(files, tmp_path_factory) -> tuple[Path, int, str]:
    """A real 2-step run with checkpoints, on data where some examples are longer than --src-len."""
    out = tmp_path_factory.mktemp("runs") / "run"
    rc, stdout, _err = run_main(train_argv(data=files["long"], out=out, save_every=1))
    return out, rc, stdout


def test_long_examples_are_truncated_with_a_count_not_an_error(finished_run):
    out, rc, stdout = finished_run
    assert rc == 0
    assert "10 of 40 examples were longer than --src-len 8 / --tgt-len 48 and were truncated" in stdout
    assert (out / "final" / "config.json").is_file()


def test_existing_run_is_left_untouched_without_resume_or_overwrite(finished_run, files):
    out = finished_run[0]
    before = tree_digest(out)
    rc, _, err = run_main(train_argv(data=files["long"], out=out, save_every=1))
    assert rc == 2
    assert_one_line_error(err, r"already holds a run: add --resume to continue it, --overwrite to replace it")
    assert tree_digest(out) == before


def test_resume_refuses_a_checkpoint_of_another_model(finished_run, files):
    out = finished_run[0]
    before = tree_digest(out)
    rc, _, err = run_main(train_argv(model="gpt2-tiny", data=files["text"], out=out, resume=True))
    assert rc == 2
    assert_one_line_error(err, r"step-00000002 is a checkpoint of model 't5-tiny', not 'gpt2-tiny': resume with "
                               r"--model t5-tiny")
    assert tree_digest(out) == before


def test_overwrite_never_deletes_a_folder_fitone_did_not_write(tmp_path, files):
    """--overwrite deletes the run dir; a folder of the user's own (here a saved model) is refused."""
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (mine / "model.safetensors").write_bytes(b"weights")
    rc, _, err = run_main(train_argv(data=files["few"], batch_size="1", out=mine, overwrite=True))
    assert rc == 2
    assert_one_line_error(err, r"not a fitone run, and --overwrite would delete them")
    assert (mine / "model.safetensors").read_bytes() == b"weights"


def _subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitone", *argv], cwd=cwd, env=child_env(), capture_output=True,
                          text=True, timeout=300)


def test_bad_input_through_a_real_process(finished_run, files, tmp_path):
    """The console path end to end: exit status 2 and a single line on stderr, no traceback."""
    missing = _subprocess(train_argv(data="missing.jsonl", out=tmp_path / "run"), cwd=tmp_path)
    assert missing.returncode == 2
    assert_one_line_error(missing.stderr, r"missing\.jsonl does not exist: give the path of a \.jsonl/\.json, \.csv or "
                                          r"\.parquet file")
    assert not (tmp_path / "run").exists()

    out = finished_run[0]
    before = tree_digest(out)
    existing = _subprocess(train_argv(data=files["long"], out=out), cwd=tmp_path)
    assert existing.returncode == 2
    assert_one_line_error(existing.stderr, r"already holds a run")
    assert tree_digest(out) == before


# -- what the CLI says before it imports torch, DeepSpeed or transformers -------------------------
# A child runs fitone.cli.main as the console script does and prints, last on stderr, its exit code and
# which of the heavy packages it imported: those take seconds of CPU, and none of these paths needs them.
_HEAVY = ("torch", "deepspeed", "transformers", "datasets")
_LIGHT_CHILD = f"""
import json, sys
from fitone.cli import build_parser, main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {_HEAVY!r} if m in sys.modules)}}), file=sys.stderr)
"""

# (argv, exit code, a pattern the output must match)
LIGHT_PATHS = [
    (["--help"], 0, r"usage: fitone"),
    (["--version"], 0, r"fitone \d"),
    (["train", "--help"], 0, r"--batch-size"),
    (["plan", "--help"], 0, r"--gpu-mem"),
    (["probe-batch", "--help"], 0, r"--max-batch"),
    (["recipes"], 0, r"t5-3b/24gb"),
    (["train", "--model", "t5-tiny", "--batch-sise", "4"], 2, r"did you mean --batch-size\?"),
    (["train", "--src-len", "long"], 2, r"invalid int value: 'long'"),
    (["train", "--batch-size", "abc"], 2, r"--batch-size must be a positive whole number.*'abc'"),
    (["plan", "--batch-size", "abc"], 2, r"--batch-size must be a positive whole number.*'abc'"),
    (["train", "--recipe", "t5-3b/24g"], 2, r"no recipe named 't5-3b/24g': did you mean 't5-3b/24gb'"),
    (["train", "--recipe", "t5-3b/24gb", "bach_size=4"], 2, r"unknown key 'bach_size'.*did you mean 'batch_size'"),
    (["probe-batch", "--recipe", "t5-3b/24gb", "bach_size=4"], 2, r"unknown key 'bach_size'"),
    (["train", "--model", "t5-tiny", "--max-gpu-memory", "24XB"], 2, r"cannot read --max-gpu-memory '24XB'"),
]


@pytest.mark.parametrize("argv,code,pattern", LIGHT_PATHS, ids=[" ".join(c[0]) for c in LIGHT_PATHS])
def test_help_and_refusals_that_need_no_model_import_no_torch(argv, code, pattern, tmp_path):
    run = subprocess.run([sys.executable, "-c", _LIGHT_CHILD, *argv], cwd=tmp_path, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    *said, last = run.stderr.strip().splitlines()
    report = json.loads(last)
    assert report == {"rc": code, "heavy": []}, run.stderr
    assert re.search(pattern, run.stdout + "\n".join(said)), run.stdout + run.stderr
    assert "Traceback" not in run.stderr


def test_python_m_fitone_help_imports_no_torch(tmp_path):
    """The `python -m fitone` entry (fitone/__main__.py) too, seen in the interpreter's own import log."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "fitone", "train", "--help"], cwd=tmp_path,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--batch-size" in run.stdout, run.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "fitone.cli.options" in imported  # the log is this command's (importlib's own imports go unlogged)
    assert not {m for m in imported if m.split(".")[0] in _HEAVY}


_API_CHILD = """
import sys
import fitone
assert not [m for m in ("torch", "deepspeed", "transformers") if m in sys.modules], "import fitone imported them"
from fitone.train import Trainer  # a submodule named like the function, loaded first
from fitone.plan import preflight
from fitone import TrainConfig, plan, train
assert fitone.train is train and fitone.train.__module__ == "fitone.train" and callable(fitone.plan)
assert plan.__name__ == "plan" and fitone.TrainConfig is TrainConfig
assert set(fitone.__all__) <= set(dir(fitone))
print("OK", fitone.probe_batch.__name__, fitone.Plan.__name__, fitone.ProbeResult.__name__,
      fitone.TrainResult.__name__, fitone.FitoneError.__name__, fitone.load_recipe.__name__)
"""


def test_import_fitone_is_light_and_the_api_loads_on_first_use(tmp_path):
    run = subprocess.run([sys.executable, "-c", _API_CHILD], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["OK", "probe_batch", "Plan", "ProbeResult", "TrainResult", "FitoneError",
                                  "load_recipe"]


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"fitone": parser, **sub.choices}


@pytest.mark.parametrize("command", list(_command_parsers()))
def test_every_option_s_help_gives_its_default_once(command):
    parser = _command_parsers()[command]
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            assert len(re.findall(r"\(default", action.help)) <= 1, (action.option_strings, action.help)
    if command == "train":
        assert "(default: train)" in parser.format_help()  # --data-split's, said once


@pytest.mark.parametrize("command,extra", [("train", ["--batch-size", "auto", "--max-steps", "1"]),
                                           ("probe-batch", [])])
def test_the_cpu_s_refusal_to_probe_names_only_flags_the_command_has(command, extra):
    """Advice names the flags of the command that was run; a flag of another command only inside a quoted
    `fitone OTHER ...` command line, which must parse as that command's."""
    argv = [command, "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp32", "--src-len",
            "8", "--tgt-len", "8", *extra]
    rc, _out, err = run_main(argv)
    line = assert_one_line_error(err, r"on the CPU nothing runs out of memory.*--batch-size N")
    assert rc == 2
    parsers = _command_parsers()

    def flags_of(name: str) -> set[str]:
        return {flag for action in parsers[name]._actions for flag in action.option_strings}

    for other, quoted in re.findall(r"`fitone ([a-z-]+)([^`]*)`", line):
        assert set(re.findall(r"--[a-z][a-z-]*", quoted)) <= flags_of(other), quoted
    named = set(re.findall(r"--[a-z][a-z-]*", re.sub(r"`fitone [^`]*`", "", line)))
    assert named and named <= flags_of(command), named - flags_of(command)
