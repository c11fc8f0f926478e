"""What a newcomer sees: no third-party noise unless --verbose, a CPU default that runs, and --offload none
without any JIT-built DeepSpeed op. Child processes where the noise is once per process (DeepSpeed's
accelerator and op checks) or needs an environment this test process does not have (no HF_HUB_OFFLINE)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conftest import child_env, fixed_batch, run_main
from fitone.config import TrainConfig
from fitone.ds_config import build_ds_config
from fitone.run import resolve_planned

NOISE = ("[WARNING]", "cannot find -laio", "collect2", "Retrying", "Writing model shards", "IProgress")


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env or child_env(), capture_output=True, text=True,
                          timeout=600, check=False)


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


def test_plan_on_a_machine_without_a_gpu_prints_no_deepspeed_warning():
    run = _child("from fitone.cli import main; raise SystemExit(main(['plan', '--model', 't5-3b', '--from-scratch', "
                 "'--gpu-mem', '24GiB']))")
    assert run.returncode == 0, run.stderr
    assert "t5-3b: 2.85B params" in run.stdout
    assert _noise(run.stdout + run.stderr) == []


def test_deepspeeds_op_check_on_the_cpu_prints_no_linker_errors():
    """In Jupyter, Python's sys.stderr is not file descriptor 2, which DeepSpeed's check silences; the linker
    writes to descriptor 2 (the kernel shows it in the cell). The child reproduces that."""
    run = _child("import sys; sys.stderr = sys.stdout\n"  # Python's stderr on descriptor 1, as Jupyter's is elsewhere
                 "from fitone.config import TrainConfig\n"
                 "from fitone.run import start_runtime\n"
                 "cfg = TrainConfig(model='t5-tiny', from_scratch=True, device='cpu', precision='fp32')\n"
                 "start_runtime(cfg)\n"
                 "import deepspeed.ops; print('probed', len(deepspeed.ops.__compatible_ops__))\n")
    assert run.returncode == 0, run.stderr
    assert "probed" in run.stdout  # the check ran (and was answered) in this process
    assert _noise(run.stdout + run.stderr) == [], run.stderr


def test_an_unknown_model_without_a_network_is_one_line_at_once():
    """No HF_HUB_OFFLINE and a hub that cannot be reached (a closed local port stands for no network):
    huggingface_hub would retry with backoff for ~28 s, a warning line per try."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    env = child_env(drop=("HF_HUB_OFFLINE",))
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    run = subprocess.run([sys.executable, "-m", "fitone", "train", "--model", "someone/no-such-model", "--device",
                          "cpu", "--precision", "fp32"], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fitone: error: cannot load model id 'someone/no-such-model'"), \
        run.stderr


def test_on_the_cpu_a_run_that_names_no_precision_trains_in_fp32_with_a_note(tmp_path, capfd):
    """The README's first command without --precision: fp16 (the GPU default) would be refused on the CPU."""
    out = tmp_path / "run"
    rc, stdout, err = run_main(["train", "--model", "t5-tiny", "--from-scratch", "--data", "sample", "--device", "cpu",
                                "--src-len", "8", "--tgt-len", "48", "--batch-size", "4", "--max-steps", "2",
                                "--eval-examples", "0", "--no-progress", "--out", str(out)])
    printed = capfd.readouterr()
    assert rc == 0, err
    assert "fitone: no GPU: training in fp32 on the CPU" in stdout + printed.out
    assert "TrainResult(2 steps" in stdout
    assert '"precision": "fp32"' in (out / "config.json").read_text()  # the run records what it used
    # the export wrote final/ without transformers' "Writing model shards" bar
    assert (out / "final" / "config.json").is_file()
    assert _noise(stdout + err + printed.out + printed.err) == []


def test_explicit_fp16_on_the_cpu_is_still_an_error():
    rc, _, err = run_main(["train", "--model", "t5-tiny", "--from-scratch", "--device", "cpu", "--precision", "fp16"])
    assert rc == 2 and "fp16 needs a CUDA GPU" in err


def test_auto_precision_is_fp16_on_a_gpu_and_fp32_on_the_cpu_in_the_deepspeed_config():
    cfg = TrainConfig(model="t5-tiny", from_scratch=True)
    assert cfg.precision == "auto"
    assert "fp16" in build_ds_config(resolve_planned(cfg, 1).with_batch(1))  # planned for a GPU
    cpu = build_ds_config(resolve_planned(cfg.replace(device="cpu"), 1).with_batch(1))
    assert "fp16" not in cpu and "bf16" not in cpu


def ds_at_one(cfg: TrainConfig) -> dict:
    """The DeepSpeed config of the tiny T5 at micro-batch 1, as planned for a GPU (or --device cpu's)."""
    return build_ds_config(resolve_planned(cfg.replace(model="t5-tiny", from_scratch=True), 1).with_batch(1))


def test_offload_none_takes_torch_adamw_fused_on_a_gpu():
    gpu = ds_at_one(TrainConfig(offload="none", lr=2e-4))["optimizer"]
    assert gpu == {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                               "torch_adam": True, "fused": True}}
    cpu = ds_at_one(TrainConfig(offload="none", device="cpu", precision="fp32"))["optimizer"]
    assert cpu["params"]["torch_adam"] is True and cpu["params"]["fused"] is False
    # the offloaded optimizer stays DeepSpeedCPUAdam (the pipelined update runs it)
    offloaded = ds_at_one(TrainConfig(offload="cpu"))["optimizer"]["params"]
    assert "torch_adam" not in offloaded and "fused" not in offloaded


def test_offload_none_keeps_another_optimizer_from_ds_config(tmp_path):
    path = tmp_path / "lamb.json"
    path.write_text('{"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}')
    ds = ds_at_one(TrainConfig(offload="none", ds_config=str(path)))
    assert ds["optimizer"]["type"] == "Lamb" and "torch_adam" not in ds["optimizer"]["params"]


def test_offload_none_builds_no_deepspeed_op_and_trains(monkeypatch):
    """DeepSpeed's FusedAdam is JIT-built at the first engine (and that build fails on Hopper's arch '9.0a').
    After the process group is up (its shm op is DeepSpeed's, not the optimizer's), any op load fails here."""
    import torch
    from deepspeed.ops.op_builder.builder import OpBuilder

    from fitone.engine import Engine
    from fitone.run import start_runtime
    from fitone.models import build_model, load_config

    cfg = TrainConfig(model="t5-tiny", from_scratch=True, device="cpu", precision="fp32", offload="none", lr=1e-3)
    run = start_runtime(cfg)
    loaded = []

    def no_build(self, verbose=True):
        loaded.append(self.name)
        raise AssertionError(f"--offload none loaded DeepSpeed op {self.name}")

    monkeypatch.setattr(OpBuilder, "load", no_build)
    monkeypatch.setattr(OpBuilder, "jit_load", no_build)
    torch.manual_seed(0)
    engine = Engine(build_model(load_config("t5-tiny", from_scratch=True)),
                    build_ds_config(run.with_batch(4).with_steps(100)))
    try:
        assert type(engine.ds.basic_optimizer) is torch.optim.AdamW
        losses = []
        for _ in range(20):  # one batch, learnt: the optimizer steps
            loss = engine.forward(fixed_batch(0))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        assert losses[-1] < 0.8 * losses[0], losses
    finally:
        engine.close()
    assert loaded == []


@pytest.mark.parametrize("argv, hint", [
    (["train", "--model", "t5-tiny", "--batch-sise", "4"], "did you mean --batch-size?"),
    (["plan", "--model", "t5-3b", "--gpu-memm", "24GiB"], "did you mean --gpu-mem?"),
    (["train", "--seq-lenn=64"], "did you mean --seq-len?"),
])
def test_a_misspelled_flag_names_the_nearest_one(argv, hint, capsys):
    from fitone.cli import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fitone") and err.strip().endswith(hint), err


def test_help_shows_the_defaults(capsys):
    from fitone.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(default: auto)", "(default: 128)", "(default: 512)", "(default: 0.0001)", "(default: cpu)",
                  "(default: on)", "(default: 0.95)"):
        assert shown in text, shown


@pytest.mark.parametrize("argv", [
    ["--model", "t5-tiny", "--from-scratch", "--seq-len", "64"],
    ["--recipe", "t5-tiny/cpu", "seq_len=64"],
])
def test_seq_len_on_a_seq2seq_model_is_an_error(argv):
    rc, _, err = run_main(["train", *argv, "--device", "cpu", "--precision", "fp32"])
    assert rc == 2
    assert err.strip() == ("fitone: error: --seq-len is for causal LMs; t5-tiny is seq2seq: give --src-len and "
                           f"--tgt-len (now {8 if '--recipe' in argv else 128} and "
                           f"{48 if '--recipe' in argv else 128}) instead")
