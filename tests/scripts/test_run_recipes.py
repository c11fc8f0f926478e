"""scripts/bench_recipes.py, the one command that runs every shipped GPU recipe, in its CPU dry run:
real child processes train the tiny model of each recipe's task; the GPU numbers only count on the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import child_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_recipes.py"


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", "2", *args],
                          env={**child_env(), "FITONE_RECIPES_DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=900, check=False)


def test_the_dry_run_trains_each_recipe_in_a_child_and_records_it(tmp_path):
    run = _dry_run(tmp_path)  # the dry run's two recipes
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((tmp_path / "recipes.json").read_text())
    assert results["machine"]["dry_run"] is True
    seq2seq, causal = results["recipes"]
    # t5-large/24gb is an --offload none recipe: it trains with torch's AdamW (no DeepSpeed op to build)
    assert seq2seq["recipe"] == "t5-large/24gb" and seq2seq["status"] == "ran" and seq2seq["offload"] == "none"
    assert seq2seq["micro_batch"] == 2 and seq2seq["steps"] == 2 and seq2seq["samples_per_s"] > 0
    assert seq2seq["peak_host_process_gib"] >= seq2seq["peak_host_train_gib"] > 0
    assert seq2seq["tokens_per_s"] is None  # seq2seq: samples/s only
    assert causal["recipe"] == "gpt2-xl/16gb" and causal["lengths"] == {"seq_len": 32}
    assert causal["tokens_per_s"] == causal["samples_per_s"] * 32
    table = (tmp_path / "recipes.md").read_text()
    assert "DRY RUN" in table and "| t5-large/24gb | ran 2 steps | 2 (-) |" in table
    assert (tmp_path / "logs" / "t5-large-24gb.log").read_text() == ""  # a quiet run has nothing to say


def test_a_recipe_past_the_budget_is_recorded_with_how_to_run_it_alone(tmp_path):
    run = _dry_run(tmp_path, "--budget-s", "0", "--recipes", "t5-3b/80gb")
    assert run.returncode == 1  # not every recipe ran
    (record,) = json.loads((tmp_path / "recipes.json").read_text())["recipes"]
    assert record["status"] == "skipped" and "--recipes t5-3b/80gb" in record["error"]


def test_an_unknown_recipe_name_is_refused(tmp_path):
    run = _dry_run(tmp_path, "--recipes", "t5-3b/8gb")
    assert run.returncode == 1 and "not a shipped GPU recipe: t5-3b/8gb" in run.stderr
