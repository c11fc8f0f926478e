"""scripts/bench_train.py's partial record: a run cut by a hard time limit (the GPU session's, a `timeout`)
leaves its host peaks and its steps so far behind, where the full record would have been lost."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # bench_train imports the harness's helpers


def _load():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_partial_record_has_the_host_peaks_and_the_steps_so_far(tmp_path):
    bench = _load()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i, "loss": 10.0 - i, "step_s": 2.0 + (i == 5), "samples_per_s": 8.0} for i in range(1, 8)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"tag": "t", "params": 2**30, "seq_len": 512, "micro_batch": 4, "grad_accum": 2}
    samples = [(0.0, 1.0, "start"), (0.2, 30.0, "engine init"), (0.4, 42.5, "steps"), (0.6, 41.0, "steps")]
    dest = tmp_path / "bench7b-t.partial.json"

    bench.write_partial(dest, record, samples, ["train", f"out={run_dir}"])

    got = json.loads(dest.read_text())
    assert got["partial"] is True and got["tag"] == "t"
    assert got["peak_host_gib_by_phase"] == {"start": 1.0, "engine init": 30.0, "steps": 42.5}
    assert got["host_bytes_per_param_before_export"] == 42.5
    assert got["steps"] == 7 and got["loss_first_last"] == [9.0, 3.0]
    assert got["median_step_s"] == 2.0  # steps 4-7 (2, 3, 2, 2): the warm-up steps are left out
    assert got["tokens_per_s"] == round(4 * 512 * 4 * 2 / 9.0, 1)
    assert "partial" not in record  # the final record is built from the run's own dict, unmarked


def test_a_partial_record_that_cannot_be_written_does_not_stop_the_run(tmp_path):
    bench = _load()
    bench.write_partial(tmp_path / "missing" / "x.json", {}, [(0.0, 1.0, "start")], ["train"])
    assert not (tmp_path / "missing").exists()


def test_alternate_losses_trains_odd_steps_with_the_own_loss_and_even_ones_with_the_fused_one(tmp_path,
                                                                                               deepspeed_ops_built):
    """A real run (gpt2-tiny on the CPU, where the fused loss is the chunked one): each optimizer step's micro-batches
    take one loss, the kinds alternate, and the record compares the two kinds of step."""
    from conftest import child_env, run_child

    run_dir = tmp_path / "run"
    proc = run_child([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "alt", "--no-export", "--loss",
                      "alternate", "--", "train", "--model", "gpt2-tiny", "--from-scratch", "--data", "synthetic",
                      "--seq-len", "16", "--batch-size", "2", "--grad-accum", "2", "--max-steps", "7",
                      "--precision", "bf16", "--eval-examples", "0", "--out", str(run_dir), "--no-progress"],
                     timeout=600, env=child_env(OUT=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "bench7b-alt.json").read_text())
    assert record["exit"] == 0
    assert record["loss_by_forward"] == ["own", "own", "fused", "fused"] * 3 + ["own", "own"]
    alternate = record["alternate"]  # the steps after the first 3: 4 and 6 fused, 5 and 7 own
    assert alternate["own"]["steps"] == 2 and alternate["fused"]["steps"] == 2
    assert len(alternate["fused_speed_over_own_per_pair"]) == 1 and alternate["fused_speed_over_own_per_pair"][0] > 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 7 and all(r["loss"] == r["loss"] for r in rows)  # finite, not nan
