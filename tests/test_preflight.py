"""Refusals before allocating: what the plan can refuse from the config alone is refused before any
weights, probe, runtime or engine exist, as one line and exit 2; a memory failure the plan did not
foresee is one line naming its phase; the host-RAM figure is what the container allows.

The big models are refused for real (their configs, this machine's RAM, a child process whose peak RSS
is read from the kernel). What the CPU cannot do is faked and said so: a GPU's size, a CUDA OOM raised
from a hook inside DeepSpeed's real engine init, and a cgroup limit written to a folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import fitone
from conftest import REPO, child_env, cpu_config, run_main
from fitone import memory
from fitone.errors import MemoryBudgetError
from fitone.plan import preflight
from fitone.run import resolve_planned
from fitone.units import GIB

CI_RAM = 24 * GIB  # the CI machine of the issue: the big models' refusal must not depend on a bigger host

# run fitone in a child whose host-RAM reading is at most CI_RAM (only the reading: on this 24 GiB machine it
# is the real one), so that the same models are refused on any host; everything else is the real command
CHILD = """
import sys
from fitone import memory
real = memory.host_available_bytes
memory.host_available_bytes = lambda: min(real(), {ram})
from fitone.cli import main
sys.exit(main(sys.argv[1:]))
"""

PATHS = {
    "train": ["train", "--max-steps", "1"],
    "probe-batch": ["probe-batch"],
    "train --batch-size auto": ["train", "--batch-size", "auto", "--max-steps", "1"],
}


def run_child(argv: list[str], tmp_path) -> tuple[int, str, float, float, int]:
    """(exit code, stderr, wall seconds, CPU seconds, peak RSS bytes) of `fitone ARGV` in a child process."""
    err_path = tmp_path / "stderr.txt"
    began = time.perf_counter()
    with open(err_path, "w") as err, open(os.devnull, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", CHILD.format(ram=CI_RAM), *argv], stdout=out, stderr=err,
                                env=child_env(), cwd=REPO)
        _pid, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS alone
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall_s, cpu_s = time.perf_counter() - began, usage.ru_utime + usage.ru_stime
    return proc.returncode, err_path.read_text(), wall_s, cpu_s, usage.ru_maxrss * 1024


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model", ["t5-11b", "llama-7b"])
def test_a_model_too_big_for_host_ram_is_refused_in_seconds_without_building_it(model, path, tmp_path):
    argv = [*PATHS[path], "--model", model, "--from-scratch", "--data", "synthetic", "--precision", "bf16",
            "--device", "cpu"]
    rc, err, wall_s, cpu_s, peak_rss = run_child(argv, tmp_path)
    assert rc == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("fitone: error:")]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    assert errors[0].startswith("fitone: error: host RAM too small") and "short" in errors[0]
    # the weights alone are 13-22 GiB in bf16: a peak of 3 GiB means nothing of the model was allocated
    assert peak_rss < 3 * GIB, peak_rss / GIB
    # seconds: the CPU time (building a 7B model alone takes minutes of it), and the wall time where this
    # machine is not shared (with more runnable processes than cores, the wall clock measures the neighbours)
    assert cpu_s < 15, cpu_s
    if os.getloadavg()[0] < (os.cpu_count() or 1):
        assert wall_s < 15, (wall_s, cpu_s)


def fake_gpu(monkeypatch, total: int) -> None:
    """This machine has no GPU: fake one of `total` bytes, all of it free (only the readings)."""
    monkeypatch.setattr(memory, "cuda_ready", lambda: True)
    monkeypatch.setattr(memory, "gpu_total_bytes", lambda device=None: total)
    monkeypatch.setattr(memory, "gpu_free_bytes", lambda: total)
    monkeypatch.setattr(memory, "gpu_name", lambda: "faked GPU")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1024 * GIB)  # the host is not the question here


def test_weights_and_states_over_the_gpu_are_refused_at_micro_batch_one(monkeypatch):
    fake_gpu(monkeypatch, 24 * GIB)
    cfg = fitone.TrainConfig(model="llama-7b", from_scratch=True, precision="bf16", device="cuda", offload="none",
                             seq_len=512)
    # without offload the optimizer states are on the GPU too: the plan's verdict at micro-batch 1 says no
    with pytest.raises(MemoryBudgetError) as info:
        preflight(resolve_planned(cfg, 1).with_batch(1))  # --device cuda on the faked GPU
    message = str(info.value)
    assert "\n" not in message and "even at micro-batch 1" in message and "--offload cpu" in message
    # a cap below the 16-bit weights (13.5 GiB): offloading cannot help, the message says what can
    capped = cfg.replace(offload="cpu", max_gpu_memory="8GiB")
    with pytest.raises(MemoryBudgetError, match="even at micro-batch 1.*a larger --max-gpu-memory"):
        preflight(resolve_planned(capped, 1).with_batch(64))  # whatever size was asked
    # under the card and with offload, it passes: the check is the plan's verdict, not a rule of thumb
    assert preflight(resolve_planned(cfg.replace(offload="cpu"), 1).with_batch(1)).max_micro_batch > 0


def test_an_engine_init_oom_is_one_line_naming_the_phase_and_verbose_shows_the_traceback(monkeypatch):
    """FAKED: a CUDA OOM, raised from a hook on DeepSpeed's ZeRO-2 optimizer-state allocation, which runs
    inside the real engine init (the CPU cannot run out of memory the way a GPU does)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (faked in engine init)")

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "initialize_optimizer_states", out_of_memory)
    argv = ["train", "--model", "t5-tiny", "--from-scratch", "--data", "sample", "--src-len", "8", "--tgt-len", "8",
            "--batch-size", "2", "--max-steps", "1", "--precision", "fp32", "--device", "cpu", "--no-progress"]
    rc, _out, err = run_main(argv)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()], err
    assert err.startswith("fitone: error: out of memory in the engine init, which the plan did not foresee")
    assert "--offload cpu" in err and "fitone plan" in err and "--verbose shows the traceback" in err
    rc, _out, err = run_main([*argv, "--verbose"])
    assert rc == 2 and "Traceback" in err and "faked in engine init" in err
    assert err.strip().splitlines()[-1].startswith("fitone: error: out of memory in the engine init")


def test_a_model_build_oom_is_one_line_naming_the_phase(monkeypatch):
    """FAKED: the allocator's failure, raised from a hook on the real build (transformers' post_init)."""
    from transformers import PreTrainedModel

    def out_of_memory(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 44 GB (faked)")

    monkeypatch.setattr(PreTrainedModel, "post_init", out_of_memory)
    with pytest.raises(MemoryBudgetError, match="out of memory in the model build, which the plan did not foresee"):
        fitone.train(cpu_config(batch_size=2, max_steps=1))


def test_the_host_ram_figure_is_the_containers_where_it_is_less(monkeypatch, tmp_path):
    """FAKED: the cgroup files, written to a folder (this machine's own limit is whatever it is)."""
    machine = memory.psutil.virtual_memory().total
    limit = min(machine // 2, 8 * GIB)
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{limit}\n")  # the parent's limit binds its child too
    (v2 / "job" / "memory.current").write_text(f"{3 * GIB}\n")
    (v2 / "job" / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {GIB}\n")  # reclaimable cache
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (v2 / "job" / "step" / "memory.current").write_text(f"{GIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert memory.cgroup_memory(v2, proc) == (limit, 2 * GIB)

    v1 = tmp_path / "v1"
    (v1 / "memory" / "box").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("0\n")
    (v1 / "memory" / "box" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (v1 / "memory" / "box" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    proc.write_text("12:cpu,cpuacct:/\n4:memory:/box\n")
    assert memory.cgroup_memory(v1, proc) == (limit, GIB)

    # what the pre-flight reads: the container's room, not the machine's
    monkeypatch.setattr(memory, "CGROUP_ROOT", v1)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    assert memory.host_available_bytes() == min(memory.psutil.virtual_memory().available, limit - GIB)
    proc.write_text("0::/\n")  # no limit anywhere: the machine's figures
    assert memory.cgroup_memory(v1, proc) is None
