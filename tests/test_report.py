"""`fitone report` and TrainResult.plot: PNGs and a summary from a real run's metrics.jsonl (tiny T5 on the
CPU); hand-written metrics files only for what a short CPU run cannot produce (NaN steps, eval records, a cap)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

import fitone
from conftest import cpu_config
from fitone.cli import main
from fitone.errors import DataError
from fitone.report import plot_losses, read_run, summarize, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, fitone.TrainResult]:
    import torch

    out = tmp_path_factory.mktemp("report") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared 2-core machine: spinning OpenMP threads only slow it
    try:
        # logged every 3 steps plus the first and the last (1, 3, 6, 8), and one held-out score at the end
        return out, fitone.train(cpu_config(max_steps=8, log_every=3, eval_examples=4, out=str(out)))
    finally:
        torch.set_num_threads(threads)


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_report_writes_the_three_pictures_and_a_summary_of_the_run(run, capsys):
    out, result = run
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    pictures = [out / "report" / name for name in ("loss.png", "throughput.png", "memory.png")]
    assert all(_is_png(p) for p in pictures)
    assert all(str(p) in printed for p in pictures)
    summary = summarize(read_run(out))
    logged = [result.losses[step - 1] for step in (1, 3, 6, 8)]
    assert summary.steps == result.steps == 8
    assert (summary.records, summary.eval_records) == (4, 1)  # the held-out score is not a logged step
    assert "8 (4 logged, 1 held-out score)" in printed
    # the first loss is step 1's, as TrainResult's, though step 1 is not a multiple of --log-every
    assert summary.first_loss == pytest.approx(result.losses[0])
    assert summary.last_loss == pytest.approx(result.losses[-1])
    assert summary.min_loss == pytest.approx(min(logged))
    assert summary.peak_host_gib > 0 and summary.median_samples_per_s > 0
    assert summary.peak_gpu_gib == 0 and summary.skipped_steps == 0  # a CPU run
    for label in ("steps", "loss", "samples/s", "peak GPU", "peak host RSS", "skipped steps"):
        assert label in printed
    assert f"{summary.last_loss:.4f} last" in printed


def test_report_out_puts_the_pictures_elsewhere(run, tmp_path):
    out, _ = run
    report = write_report(out, tmp_path / "pics")
    assert [p.parent for p in report.pictures] == [tmp_path / "pics"] * 3
    assert all(_is_png(p) for p in report.pictures)


def test_train_result_plot_draws_the_losses(run, tmp_path):
    _, result = run
    path = result.plot(tmp_path / "loss.png")
    assert path == tmp_path / "loss.png" and _is_png(path)


def test_no_pyplot_state_leaks_into_a_notebook(run, tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    write_report(run[0], tmp_path)
    plot_losses([3.0, 2.0, 1.0], tmp_path / "l.png")
    assert plt.get_fignums() == [] and matplotlib.get_backend() == backend


def test_summary_counts_nan_steps_skips_evals_and_reads_the_cap(tmp_path):
    """fp16 overflow steps and eval records do not happen in a short CPU run: written by hand here."""
    losses = [4.0, 3.0, float("nan"), 2.5, 2.0, 1.5]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss if math.isfinite(loss) else None,
                                "samples_per_s": 10.0 * step, "gpu_peak_gib": 18.0 + step / 10,
                                "host_rss_gib": 60.0 + step, "skipped_steps": 0 if step < 3 else 1}) + "\n")
        f.write(json.dumps({"step": 6, "eval_loss": 1.7, "exact_match": 0.25}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": "t5-3b", "precision": "fp16",
                                                      "max_gpu_memory": "23GiB"}))
    report = write_report(tmp_path)
    s = report.summary
    finite = [x for x in losses if math.isfinite(x)]
    assert (s.first_loss, s.last_loss, s.min_loss, s.min_loss_step) == (finite[0], finite[-1], min(finite), 6)
    assert s.nonfinite_losses == 1 and s.skipped_steps == 1 and s.steps == 6
    assert s.median_samples_per_s == statistics.median([10.0 * k for k in range(2, 7)])  # step 1 is warm-up
    assert s.peak_gpu_gib == pytest.approx(18.6) and s.peak_host_gib == 66.0 and s.gpu_cap_gib == 23.0
    assert s.eval == {"eval_loss": 1.7, "exact_match": 0.25}
    assert "of a 23.0 GiB cap" in s.table() and "1 NaN/inf losses" in s.table()
    assert all(_is_png(p) for p in report.pictures)


@pytest.mark.parametrize("content, expected", [
    (None, "no metrics file"),
    ("", "no step records yet"),
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n', "repair or delete that line"),
    ('{"epoch": 1}\n', "has no 'step' and 'loss'"),
])
def test_missing_or_garbled_metrics_is_one_line_naming_the_fix(tmp_path, capsys, content, expected):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1
    assert not (tmp_path / "report").exists()


def test_plot_losses_of_nothing_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no losses"):
        plot_losses([], tmp_path / "x.png")


def test_a_last_line_cut_short_by_a_kill_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert write_report(tmp_path).summary.steps == 2
