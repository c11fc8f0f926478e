"""The tool comparison (scripts/bench_tools.py) on CPU: real child processes, a tiny model.

Its numbers only count on the GPU; here we prove the plumbing: every tool builds the same model on the
same data, each run is its own process, records carry the promised fields with sane values, the
results file survives a child that times out or is killed, and an out-of-memory size stops larger ones.
A causal LM runs with its --seq-len, gradient accumulation and the stock loop's parameter groups.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, run_child

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_tools.py"
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts import their shared helpers (_harness, ...)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("bench_tools")
measure = _load("_tools_measure")
table = _load("bench_table")

SMOKE = ["--device", "cpu", "--batch-sizes", "2", "--steps", "2", "--warmup", "1", "--split-steps", "1",
         "--src-len", "16", "--tgt-len", "16"]


@pytest.fixture(autouse=True)
def _ops_built(deepspeed_ops_built):
    """The harness stops children at their timeouts: none of them may be the one that builds cpu_adam."""


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    # the timeout is generous: on a shared 2-core box a child's imports alone can take 40 s; one OpenMP thread
    # (child_env): there two spinning threads make a tiny model's step 100x slower
    return run_child([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=child_env(), timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One harness run: fitone, the hand-written DeepSpeed loop, HF Trainer and plain PyTorch, a child each."""
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = _run(["--tools", "fitone,deepspeed,hf-trainer,torch-plain", *SMOKE, "--out", str(out), "--log-dir"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads(out.read_text()), proc.stdout


def test_every_tool_writes_a_record_with_the_promised_fields(smoke):
    _, records, _ = smoke
    assert [r["tool"] for r in records] == ["fitone", "deepspeed", "hf-trainer", "torch-plain"]
    for r in records:
        missing = [f for f in bench.FIELDS if f not in r]
        assert not missing, (r["tool"], missing)
        assert r["error"] is None and r["oom"] is False, r
        setup = (r["model"], r["precision"], r["batch_size"], r["src_len"], r["tgt_len"], r["seq_len"])
        assert setup == ("t5-tiny", "fp32", 2, 16, 16, None)
        assert r["grad_accum"] == 1
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * (16 + 16), rel=1e-3)  # source + target
        assert r["gpu"] == "cpu" and r["cap_gib"] is None and r["date"]
        assert "--device cpu" in r["command"] and r["command"].startswith("python ")


def test_step_times_are_medians_of_the_timed_steps(smoke):
    _, records, _ = smoke
    for r in records:
        assert len(r["step_times"]) == 2  # --steps 2: warm-up and split steps are not in the timing
        lo, hi = r["step_s_spread"]
        assert 0 < lo <= r["step_s"] <= hi
        assert r["step_s"] == pytest.approx(sorted(r["step_times"])[0] / 2 + sorted(r["step_times"])[1] / 2, abs=1e-3)
        assert r["samples_per_s"] == pytest.approx(2 / r["step_s"], rel=0.01)
        assert 0 < r["peak_host_gib"] < 64 and r["peak_gpu_gib"] == 0  # no GPU here
        assert r["init_s"] >= 0


def test_all_tools_train_the_same_model_on_the_same_data(smoke):
    """Same seed, same config, same first batch: the first loss agrees to fp32 noise across tools.
    (HF Trainer's sampler shuffles the rows, so its first batch differs; its weights do not.)"""
    from fitone.models import build_model, load_config

    _, records, _ = smoke
    n_params = sum(p.numel() for p in build_model(load_config("t5-tiny", from_scratch=True), meta=True).parameters())
    assert {r["params"] for r in records} == {n_params}
    first = [r["loss_first"] for r in records if r["tool"] != "hf-trainer"]
    assert all(math.isfinite(x) for x in first)
    assert max(first) - min(first) < 1e-3, first


def test_each_loop_records_where_a_step_goes(smoke):
    _, records, _ = smoke
    for r in records:
        split = r["split"]
        assert {"forward_s", "backward_s", "optimizer_s"} <= split.keys()
        assert sum(split[k] for k in ("forward_s", "backward_s", "optimizer_s")) <= r["step_s_spread"][1] * 1.5
    for r in records[:3]:  # fitone and HF Trainer (their engines captured) and the hand-written loop
        detail = r["split_detail"]
        for key in ("grad_transfer_s", "cpu_adam_s", "param_upload_s", "backward_compute_s"):
            assert detail[key] >= 0, (r["tool"], key)
        assert detail["cpu_adam_s"] > 0  # DeepSpeedCPUAdam really ran in the detail step


def test_fitone_records_each_timed_steps_phases_and_where_its_window_began(smoke):
    _, records, _ = smoke
    fit = records[0]
    assert fit["tool"] == "fitone" and fit["warmup_used"] == 1  # fp32: no skipped step, so no margin
    assert [s["step_s"] for s in fit["per_step"]] == pytest.approx(fit["step_times"], abs=1e-3)
    for step in fit["per_step"]:
        assert step["applied"] is True and all(step[k] > 0 for k in ("forward_s", "backward_s", "optimizer_s"))
    # the loops this harness drives start their window after --warmup 1 too (HF Trainer's own loop records none)
    assert [r["warmup_used"] for r in records if r["tool"] != "hf-trainer"] == [1, 1, 1]


def test_child_logs_and_table_are_written(smoke):
    out, records, stdout = smoke
    logs = sorted(p.name for p in (out.parent / "results-logs").iterdir())
    assert logs == ["deepspeed-b2.log", "fitone-b2.log", "hf-trainer-b2.log", "torch-plain-b2.log"]
    for tool in ("fitone", "deepspeed", "hf-trainer", "torch-plain"):
        assert f"| {tool} | none | 2 |" in stdout  # the table printed at the end
    assert re.search(r"bench: 4 records written to \S+ in \d+ s", stdout)  # and how long the whole run took
    rendered = table.render(records)
    assert "Where a step's time goes" in rendered and rendered.count("| deepspeed |") == 2
    assert all(f"| {r['step_s']:.3f} (" in rendered for r in records)


def test_the_update_modes_run_as_their_own_tools(tmp_path):
    out = tmp_path / "overlapped.json"
    proc = _run(["--tools", "fitone-delayed,fitone-pipelined,fitone-deepspeed-step", *SMOKE, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    delayed, pipelined, plain = json.loads(out.read_text())
    assert delayed["tool"] == "fitone-delayed" and delayed["update"] == "delayed" and not delayed["pipelined_update"]
    assert pipelined["tool"] == "fitone-pipelined" and pipelined["update"] == "pipelined"
    assert plain["tool"] == "fitone-deepspeed-step" and plain["update"] == "deepspeed"
    for r in (delayed, pipelined, plain):
        assert r["error"] is None and len(r["step_times"]) == 2 and math.isfinite(r["loss_last"])
        assert r["samples_per_s"] > 0
    # the split detail (syncs inside ZeRO-2's step) only where DeepSpeed's step ran
    assert "split_detail" in plain and "split_detail" not in pipelined and "split_detail" not in delayed
    # an overlapped update's own counters instead, from the timed step in which it completed
    for r in (delayed, pipelined):
        split = r["split"]
        assert 0 < split["update_cpu_adam_s"] <= split["update_thread_s"] and split["update_wait_s"] >= 0, r
    assert not any(k.startswith("update_") for k in plain["split"])
    rendered = table.render([delayed, pipelined, plain])  # the counters get their own columns
    assert "| update: cpu_adam | update: thread | update: wait |" in rendered
    assert f"| {pipelined['split']['update_wait_s']:.3f} |" in rendered


def test_the_widening_variants_are_fitone_tools_that_cap_and_accumulate():
    """fitone-widen-2m / -8m (Adam's 16-bit gradients widened in slices; a GPU A/B, bench/NOTES.md) run
    fitone's defaults, capped and with --grad-accum, as the tool `fitone` does."""
    assert set(measure.WIDEN_VARIANTS) == {"fitone-widen-2m", "fitone-widen-8m"}
    for tool, elements in measure.WIDEN_VARIANTS.items():
        assert tool in bench.TOOLS and tool in bench.CAPPED and tool in bench.ACCUMULATING
        assert tool not in measure.FITONE_VARIANTS and elements % 256 == 0  # whole SIMD blocks (zero2.overlap)


def test_the_speculative_variant_is_a_fitone_tool_that_caps_and_accumulates():
    """fitone-speculative (--speculative-update; a GPU A/B against fitone-pipelined, bench/NOTES.md)."""
    from fitone.config import TrainConfig

    tool = "fitone-speculative"
    assert tool in bench.TOOLS and tool in bench.CAPPED and tool in bench.ACCUMULATING
    TrainConfig(model="t5-tiny", **measure.FITONE_VARIANTS[tool]).validate()


def test_a_child_that_times_out_leaves_an_error_record_and_the_file(tmp_path):
    out = tmp_path / "r.json"
    proc = _run(["--tools", "deepspeed", *SMOKE, "--out", str(out), "--timeout", "2"], timeout=120)
    assert proc.returncode == 1  # a run that did not finish is reported, not hidden
    (rec,) = json.loads(out.read_text())
    assert rec["tool"] == "deepspeed" and rec["error"].startswith("timeout after 2 s")
    assert rec["step_s"] is None


def test_results_append_to_an_existing_file(tmp_path):
    """A second run naming the same file adds to it (run_jobs reads what is there first)."""
    out = tmp_path / "r.json"
    out.write_text(json.dumps([{"tool": "earlier"}]))
    args = bench.parse_args(["--tools", "torch-plain-uncapped", *SMOKE, "--out", str(out)])
    job = bench.plan_jobs(args)[0]
    ctx = {"gpu": "cpu", "date": "2026-01-01", "command": "python scripts/bench_tools.py"}
    # the job as a child with a budget already spent: it is not started, and says so
    new, interrupted = bench.run_jobs([job], ctx, out, None, budget=0)
    assert not interrupted and new[0]["error"] == "not run: --budget spent"
    assert [r["tool"] for r in json.loads(out.read_text())] == ["earlier", "torch-plain-uncapped"]


def test_an_oom_stops_larger_sizes_of_that_tool(tmp_path, monkeypatch):
    """CPU cannot run out of GPU memory, so the child's answer is faked: batch 4 OOMs, 8 is never started."""
    started = []

    def fake_run_job(job, timeout, log_path):
        started.append(job["sizes"])
        log_path.write_text("")
        size = job["sizes"][0]
        rec = {"batch_size": size, "oom": size >= 4, "oom_message": "CUDA out of memory" if size >= 4 else None,
               "step_s": 1.0, "samples_per_s": float(size)}
        return [rec], {}, ""

    monkeypatch.setattr(bench, "run_job", fake_run_job)
    args = bench.parse_args(["--tools", "deepspeed", "--device", "cpu", "--batch-sizes", "2,4,8", "--out",
                             str(tmp_path / "r.json")])
    ctx = {"gpu": "cpu", "date": "2026-01-01", "command": "x"}
    new, _ = bench.run_jobs(bench.plan_jobs(args), ctx, tmp_path / "r.json", None, budget=None)
    assert started == [[2], [4]]
    assert [(r["batch_size"], r["oom"]) for r in new] == [(2, False), (4, True), (8, True)]
    assert "not run" in new[2]["note"]
    assert "OOM" in table.render(new)


def test_plan_groups_sizes_only_where_an_engine_can_be_reused():
    args = bench.parse_args(["--same-process", "--tools", "fitone,deepspeed,torch-plain,hf-trainer-auto-find"])
    jobs = [(j["tool"], j["sizes"], j["cap"]) for j in bench.plan_jobs(args)]
    assert jobs == [
        ("fitone", [8], "23GiB"), ("fitone", [64], "23GiB"), ("fitone", [256], "23GiB"),
        ("deepspeed", [8, 64, 256], "23GiB"),
        ("torch-plain", [1, 8, 64, 256], "23GiB"),  # the blog's claim: plain fp16 fails at batch 1 under the cap
        ("hf-trainer-auto-find", [320], "23GiB"),  # starts above the largest size, 1.25x
    ]
    uncapped = bench.plan_jobs(bench.parse_args(["--tools", "torch-plain-uncapped", "--batch-sizes", "256"]))
    assert uncapped[0]["cap"] is None


def test_defaults_follow_the_device_and_quick_mode():
    cpu = bench.parse_args(["--device", "cpu"])
    assert (cpu.model, cpu.precision, cpu.cap) == ("t5-tiny", "fp32", None)
    quick = bench.parse_args(["--quick"])
    assert (quick.model, quick.batch_sizes, quick.tools, quick.same_process) == (
        "t5-large", [16, 64], ["fitone", "deepspeed"], True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--precision", "fp16"])  # DeepSpeed refuses fp16 on CPU
    with pytest.raises(SystemExit):
        bench.parse_args(["--tools", "fitone,megatron"])


def test_default_results_name_is_date_and_gpu(tmp_path):
    assert bench.resolve_out(None, "NVIDIA H200", "2026-11-29") == ROOT / "bench/results/2026-11-29-nvidia-h200.json"
    assert bench.resolve_out(str(tmp_path), "NVIDIA H200", "2026-11-29") == tmp_path / "2026-11-29-nvidia-h200.json"
    assert bench.resolve_out(str(tmp_path / "x.json"), "cpu", "2026-11-29") == tmp_path / "x.json"


CAUSAL = ["--model", "gpt2-tiny", "--device", "cpu", "--precision", "bf16", "--seq-len", "16", "--grad-accum", "2",
          "--ds-param-groups", "2", "--batch-sizes", "2", "--steps", "2", "--warmup", "1", "--split-steps", "1"]


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    """fitone and the stock DeepSpeed loop on a causal LM, 2 micro-batches of 2 x 16 tokens a step."""
    out = tmp_path_factory.mktemp("causal") / "results.json"
    proc = _run(["--tools", "fitone,deepspeed", *CAUSAL, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_a_causal_lm_runs_at_its_seq_len_with_accumulation(causal):
    records, _ = causal
    assert [r["tool"] for r in records] == ["fitone", "deepspeed"]
    for r in records:
        missing = [f for f in bench.FIELDS if f not in r]
        assert not missing, (r["tool"], missing)
        assert r["error"] is None and r["oom"] is False, r
        assert (r["model"], r["precision"], r["seq_len"], r["src_len"], r["tgt_len"]) == ("gpt2-tiny", "bf16", 16,
                                                                                          None, None)
        assert (r["batch_size"], r["grad_accum"]) == (2, 2)
        assert len(r["step_times"]) == 2 and math.isfinite(r["loss_last"])
        # a step is 2 micro-batches of 2: samples/s and tokens/s count all 4 sequences of 16 tokens
        assert r["samples_per_s"] == pytest.approx(4 / r["step_s"], rel=0.01)
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16, rel=1e-3)


def test_the_split_adds_up_every_micro_batch_of_a_step(causal):
    """forward/backward/optimizer are summed over the step's micro-batches, so they make up the step; counted
    per micro-batch they would be about half of it."""
    records, _ = causal
    for r in records:
        parts = sum(r["split"][k] for k in ("forward_s", "backward_s", "optimizer_s"))
        assert 0.7 * r["step_s_spread"][0] <= parts <= 1.5 * r["step_s_spread"][1], (r["tool"], parts, r["step_s"])
        assert r["split_detail"]["cpu_adam_s"] > 0  # the detail step is a whole optimizer step too


def test_the_stock_loop_hands_deepspeed_the_parameter_groups(causal):
    records, stdout = causal
    fitone, stock = records
    assert stock["ds_param_groups"] == 2 and "ds_param_groups" not in fitone
    sizes = stock["ds_param_group_sizes"]
    assert len(sizes) == 2 and min(sizes) > 0 and sum(sizes) == stock["params"]
    # fitone's own init peak is recorded where its Engine counts one (None until then); the harness's reading
    assert "engine_init_peak_gpu_gib" in fitone and fitone["peak_gpu_init_gib"] == 0  # no GPU here
    assert "| deepspeed (2 groups) | none | 2 x 2 = 4 |" in stdout
    assert "seq 16" in stdout and "| tokens/s |" in stdout


def test_param_groups_are_consecutive_and_about_equal():
    """llama-7b's parameters in 16 groups, the reference the 7B speed bar compares against."""
    from fitone.models import build_model, load_config

    params = list(build_model(load_config("llama-7b", from_scratch=True), meta=True).parameters())
    groups = measure.split_param_groups(params, 16)
    assert len(groups) == 16 and [p for g in groups for p in g] == params  # every parameter once, in order
    sizes = [sum(p.numel() for p in g) for g in groups]
    assert max(sizes) <= 1.15 * min(sizes), sizes
    assert [len(g) for g in measure.split_param_groups(params[:3], 16)] == [1, 1, 1]  # never an empty group


def test_the_new_options_are_planned_and_checked():
    args = bench.parse_args(["--model", "llama-7b", "--precision", "bf16", "--seq-len", "512", "--batch-sizes", "8",
                             "--tools", "fitone,deepspeed", "--ds-param-groups", "16", "--grad-accum", "1,4"])
    jobs = [(j["tool"], j["sizes"], j["grad_accum"], j.get("ds_param_groups"), j["seq_len"], j["task"])
            for j in bench.plan_jobs(args)]
    assert jobs == [("fitone", [8], 1, None, 512, "causal"), ("fitone", [8], 4, None, 512, "causal"),
                    ("deepspeed", [8], 1, 16, 512, "causal"), ("deepspeed", [8], 4, 16, 512, "causal")]
    from fitone.config import TrainConfig

    assert bench.parse_args(["--model", "gpt2-tiny", "--device", "cpu"]).seq_len == 512  # fitone's default
    # the parent keeps fitone's length defaults itself (importing fitone there costs tens of seconds)
    assert bench.LENGTHS == {k: TrainConfig.__dataclass_fields__[k].default for k in bench.LENGTHS}
    t5 = bench.parse_args([])
    assert (t5.model, t5.src_len, t5.tgt_len, t5.grad_accum, t5.ds_param_groups) == ("t5-3b", 128, 128, [1], 1)
    for bad in (["--seq-len", "64"],  # t5-3b is seq2seq
                ["--model", "gpt2-tiny", "--src-len", "64"],
                ["--grad-accum", "4"],  # the default tools include HF Trainer and plain PyTorch
                ["--tools", "deepspeed", "--ds-param-groups", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_a_child_killed_by_the_kernel_leaves_a_record_saying_so(tmp_path, monkeypatch):
    """A host-RAM OOM kill cannot be caused safely here, so the child is a stand-in that reports its phase
    and a heartbeat the way the real child does, then dies of SIGKILL as the kernel's OOM killer does it."""
    fake = tmp_path / "child.sh"
    fake.write_text("#!/bin/sh\n"
                    "echo 'BENCH_PARTIAL {\"phase\": \"engine init\", \"params\": 123}'\n"
                    "echo 'BENCH_PARTIAL {\"peak_host_gib_last_seen\": 101.5, \"last_seen_s\": 30.0}'\n"
                    "kill -9 $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(bench.sys, "executable", str(fake))  # run_job starts [sys.executable, script, ...]
    out = tmp_path / "r.json"
    args = bench.parse_args(["--tools", "deepspeed", *CAUSAL, "--out", str(out)])
    ctx = {"gpu": "cpu", "date": "2026-01-01", "command": "x"}
    new, interrupted = bench.run_jobs(bench.plan_jobs(args), ctx, out, None, budget=None)
    (rec,) = json.loads(out.read_text())
    assert rec == new[0] and not interrupted
    assert rec["error"] == "exit code -9 (killed without a traceback: host RAM ran out?) during engine init"
    assert (rec["params"], rec["peak_host_gib_last_seen"], rec["step_s"]) == (123, 101.5, None)
    assert (rec["grad_accum"], rec["seq_len"], rec["ds_param_groups"]) == (2, 16, 2)
    assert "host RSS 101.5 GiB 30 s in" in table.render([rec])


def test_check_export_loads_a_saved_model_dir_and_reports_what_came_back(tiny_gpt_dir, tiny_t5_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """scripts/check_export.py, used on the GPU after a 7B export: a causal LM and a seq2seq model load with
    from_pretrained, the record counts every parameter and has a finite forward loss; the JSON is written."""
    from transformers import AutoModel

    check = _load("check_export")
    for model_dir in (tiny_gpt_dir, tiny_t5_dir):
        out = tmp_path / model_dir.name
        monkeypatch.setattr("sys.argv", ["check_export.py", str(model_dir), "--out", str(out)])
        assert check.main() == 0
        record = json.loads((out / "export-check.json").read_text())
        assert capsys.readouterr().out.startswith("EXPORT ")
        assert record["params"] == sum(p.numel() for p in AutoModel.from_pretrained(model_dir).parameters())
        assert record["loss_is_finite"] and any(name.endswith(".safetensors") for name in record["files"])


def test_a_child_cut_by_a_test_timeout_leaves_no_process_behind(tmp_path):
    """run_child's timeout ends the whole tree: here a grandchild in a session of its own, as the benchmark
    scripts start their training children (subprocess.run's timeout kills only the direct child)."""
    import psutil

    pid_file = tmp_path / "grandchild.pid"
    parent = ("import subprocess, sys, time; "
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
              f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_child([sys.executable, "-c", parent], timeout=20)
    grandchild = int(pid_file.read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
