"""scripts/bench_pack.py, the benchmark that compares `--pack` with padded batches, in its CPU dry run:
real `fitone train` children train gpt2-tiny on long-tailed data; the GPU numbers only count on the GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, run_child

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pack.py"


@pytest.fixture(autouse=True)
def _ops_built(deepspeed_ops_built):
    """The dry run stops a child at its budget: it must not be the child that builds cpu_adam."""


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return run_child([sys.executable, str(SCRIPT), "--out", str(out), *args],
                     env={**child_env(), "FITONE_PACK_DRY_RUN": "1"}, timeout=600)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_the_dry_run_trains_packed_and_unpacked_children_and_records_both(tmp_path):
    run = _dry_run(tmp_path, "--steps", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "pack.json").read_text())
    assert result["machine"]["dry_run"] is True
    unpacked, packed = result["runs"]
    assert (unpacked["run"], unpacked["pack"], packed["run"], packed["pack"]) == ("unpacked", False, "packed", True)
    for r in (unpacked, packed):
        assert r["status"] == "ran" and r["micro_batch"] == 4 and r["steps_logged"] == 4
        assert r["steady_steps"] == [3, 4]  # the median leaves out the first two steps
        for key in ("tokens_per_s", "samples_per_s", "step_s", "peak_host_gib", "wall_s", "padding_fraction"):
            assert _real(r[key]), (key, r[key])
        assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 and 0 <= r["padding_fraction"] < 1
        assert r["command"].startswith("python3 -m fitone train --model gpt2-tiny --from-scratch --data longtail.jsonl")
    assert packed["command"].endswith(" --pack") and "--pack" not in unpacked["command"]
    # long-tailed lengths: padded batches waste more than packed rows, and packed rows hold several examples
    assert packed["padding_fraction"] <= unpacked["padding_fraction"]
    assert packed["tokens_per_row"] == 64 and packed["rows"] < packed["examples"] == unpacked["examples"] == 400
    assert _real(result["packed_over_unpacked_tokens_per_s"])
    # OUT holds these 6 files and nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "pack.json", "pack.md", "packed-metrics.jsonl", "packed.log", "unpacked-metrics.jsonl", "unpacked.log"]
    assert len((tmp_path / "packed-metrics.jsonl").read_text().splitlines()) == 4
    table = (tmp_path / "pack.md").read_text()
    assert "DRY RUN" in table and "| unpacked | ran | 4 (-) |" in table and "| packed | ran | 4 (-) |" in table


def test_a_run_past_the_budget_is_recorded_as_skipped(tmp_path):
    run = _dry_run(tmp_path, "--budget-s", "0")
    assert run.returncode == 1  # neither run ran
    result = json.loads((tmp_path / "pack.json").read_text())
    assert [(r["run"], r["status"]) for r in result["runs"]] == [("unpacked", "skipped"), ("packed", "skipped")]
    assert "budget" in result["runs"][0]["error"] and result["packed_over_unpacked_tokens_per_s"] is None


def test_the_packed_padding_count_is_each_rows_fill_after_its_last_example(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_pack
    import make_longtail_data
    from fitone.config import TrainConfig
    from fitone.data import load_dataset
    from fitone.models import CAUSAL, load_config, load_tokenizer

    data = tmp_path / "longtail.jsonl"
    make_longtail_data.main(["--out", str(data), "--examples", "200", "--median-words", "4", "--max-words", "13"])
    setup = {"model": "gpt2-tiny", "seq_len": 64}
    config = load_config("gpt2-tiny", from_scratch=True)
    tok = load_tokenizer("gpt2-tiny", config, from_scratch=True)
    examples = load_dataset(TrainConfig(model="gpt2-tiny", from_scratch=True, data=str(data), seq_len=64,
                                        eval_examples=0).data_settings(), CAUSAL, tok, config.vocab_size)
    rows = bench_pack.padding(setup, data, True, 1, 1)["rows"]
    counted = bench_pack.padding(setup, data, True, 1, rows)  # one epoch: every packed row once
    exact = 1 - sum(len(e.input_ids) for e in examples.examples) / (rows * 64)
    assert counted["examples"] == 200 and rows < 200 and exact > 0.05
    assert math.isclose(counted["padding_fraction"], exact)
