"""`fitone probe-batch` on the GPU under a small cap: the size it finds trains, and the size it saw run out
of memory does run out of memory, each in a fresh process as a user would run them (a cap is per process:
set in this one it would stay on the tests after it). tests/probe/test_search.py and test_probe_batch.py
cover the search and the trials on the CPU, where nothing runs out of memory the way a GPU does.
"""

from __future__ import annotations

import math

import pytest
from gpu_lane import metrics, needs_cuda, record, run_fitone

from fitone.units import parse_size
from fitone.probe.results import ProbeResult

pytestmark = [pytest.mark.gpu, needs_cuda]

CAP = "3GiB"  # gpt2 at 128 tokens: `fitone plan` puts the largest micro-batch near 20, so the search is short
MEMORY = ["--model", "gpt2", "--from-scratch", "--data", "synthetic", "--seq-len", "128", "--precision", "fp16",
          "--max-gpu-memory", CAP]


def test_the_probes_size_trains_and_the_size_it_saw_run_out_of_memory_does(tmp_path):
    probe = run_fitone(tmp_path, "probe-batch", *MEMORY, "--no-cache", "--json", str(tmp_path / "probe.json"))
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-3000:]
    result = ProbeResult.load_json(tmp_path / "probe.json")
    record("probe", chosen=result.chosen, largest_fit=result.largest_fit, smallest_oom=result.smallest_oom,
           verified=result.verified, trials=[t.outcome() for t in result.trials], wall_s=result.wall_s)
    assert result.verified and result.meta["update"] == "pipelined"  # training's default step, on one GPU
    assert result.smallest_oom is not None and result.chosen <= result.largest_fit < result.smallest_oom

    fits = run_fitone(tmp_path, "train", *MEMORY, "--batch-size", str(result.chosen), "--max-steps", "8",
                      "--eval-examples", "0", "--no-progress", "--out", str(tmp_path / "fits"))
    assert fits.returncode == 0, fits.stderr[-3000:]
    steps = metrics(tmp_path / "fits")
    assert len(steps) == 8 and all(math.isfinite(s["loss"]) for s in steps)
    assert max(s["gpu_peak_gib"] for s in steps) * 2**30 <= parse_size(CAP)

    over = run_fitone(tmp_path, "train", *MEMORY, "--batch-size", str(result.smallest_oom), "--max-steps", "3",
                      "--eval-examples", "0", "--no-progress", "--out", str(tmp_path / "over"))
    record("probe_next_size", returncode=over.returncode, stderr_tail=over.stderr[-500:])
    assert over.returncode == 2, over.stderr[-3000:]
    assert "GPU out of memory" in over.stderr and "Traceback" not in over.stderr
