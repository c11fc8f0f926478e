#!/usr/bin/env python3
"""Tokens/s with `--pack` against without, on data with long-tailed lengths, each at its own probed batch.

It writes long-tailed causal-LM text with scripts/make_longtail_data.py (20k examples: a median of ~145
and a tail to 1024 tokens under the shipped byte tokenizer), then trains gpt2-xl from scratch on it
twice, each in its own child process, the way a user runs it:
    python -m fitone train --model gpt2-xl --from-scratch --data longtail.jsonl --seq-len 1024 \\
        --batch-size auto --precision fp16 --max-gpu-memory 23GiB --max-steps STEPS --eval-examples 0 \\
        --no-progress --out RUN [--pack]
Each child probes its own micro-batch (a fresh probe cache: FITONE_CACHE_DIR is a new folder per run).
Unpacked, the probe sizes the batch for the data's longest examples and each batch is padded to its own
longest; packed, every row is --seq-len tokens of whole examples. Per run it records the probe's
micro-batch and largest fit, the steady tokens/s (loss tokens, no padding, as metrics.jsonl records
them; median over the steps after the first 2), samples/s (rows/s), the padding fraction of the
batches the run trained on (recomputed here from the same data, order and micro-batch), peak GPU and
host RSS over the logged steps, and the child's wall time. A child is stopped once its last step is
logged: the benchmark is done then, and the export of final/ would only spend time.
OUT gets pack.json, pack.md, each child's log and metrics.jsonl (6 files).

On a CUDA machine (one H200 was used for the results):
    python3 scripts/bench_pack.py --out $OUT
Not yet run there. Each child tokenises (the second reuses the first's datasets cache), probes (for
gpt2-xl at 1024 tokens see bench/results/2026-11-29-probe-checks/), builds its offloaded engine and trains
STEPS steps: about 3.5 minutes for both, an estimate, not a measurement. A run that would start after
--budget-s is recorded as skipped; one still running at its end is stopped (its logged steps are kept).

On a CPU (a dry run of this script, not the benchmark): FITONE_PACK_DRY_RUN=1 trains gpt2-tiny, fp32,
--device cpu, --seq-len 64, micro-batch 4 (the CPU probe needs --max-batch) on 400 short examples.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, checkout_env, env_flag, machine as _machine, num as _num  # the checkout on the path

RUNS = ("unpacked", "packed")
WARMUP_STEPS = 2  # the first steps include lazy allocations and the loss scale's first overflows
MIN_START_S = 30  # a run with less than this left could not even build its model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--out", required=True, help="folder for pack.json, pack.md and each run's log and metrics")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (tokens/s: median of 3..N)")
    p.add_argument("--examples", type=int, help="examples in the generated data (default 20000; dry run 400)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=250,
        help="start no run after this many seconds; a run still going at the budget's end is stopped "
        "(the padding count and the tables take ~10 s more: 250 fits 270 s)",
    )
    return p


def dry_run() -> bool:
    return env_flag("FITONE_PACK_DRY_RUN")


def setup() -> dict[str, Any]:
    """The model, lengths and data shape: gpt2-xl at its full context on the GPU, gpt2-tiny on the CPU.

    Lengths are in words; the shipped byte tokenizer spends ~4.8 tokens on one of make_longtail_data's
    words (with its space), so max_words is about seq_len tokens: a few examples are truncated to it."""
    if dry_run():
        return {"model": "gpt2-tiny", "seq_len": 64, "examples": 400, "median_words": 4, "max_words": 13,
                "train": ["--device", "cpu", "--precision", "fp32", "--batch-size", "4"]}
    return {"model": "gpt2-xl", "seq_len": 1024, "examples": 20_000, "median_words": 30, "max_words": 212,
            "train": ["--batch-size", "auto", "--precision", "fp16", "--max-gpu-memory", "23GiB"]}


def make_data(path: Path, s: dict[str, Any]) -> dict[str, Any]:
    import contextlib
    import io

    import make_longtail_data

    argv = ["--out", str(path), "--examples", str(s["examples"]), "--median-words", str(s["median_words"]),
            "--max-words", str(s["max_words"])]
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        make_longtail_data.main(argv)
    shown = ["python3", "scripts/make_longtail_data.py", *argv]
    shown[3] = path.name  # the data is written to a temporary folder
    return {"command": shlex.join(shown), "summary": said.getvalue().strip().replace(str(path), path.name)}


def train_command(s: dict[str, Any], data: Path, run_dir: Path, steps: int, pack: bool) -> list[str]:
    return [sys.executable, "-m", "fitone", "train", "--model", s["model"], "--from-scratch", "--data", str(data),
            "--seq-len", str(s["seq_len"]), *s["train"], "--max-steps", str(steps), "--eval-examples", "0",
            "--no-progress", "--out", str(run_dir), *(["--pack"] if pack else [])]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records written so far; a line still being written is left for the next look.

    Not fitone.metrics.read_metrics: that one reads a finished run (a missing file is an error) and importing
    fitone would load torch in this parent, which only polls its children's files."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def run_child(command: list[str], env: dict[str, str], run_dir: Path, log_path: Path, steps: int,
              deadline: float) -> tuple[str, float, int | None]:
    """Run one training child until its last step is logged, it exits, or the deadline passes.

    Returns (status, wall seconds, exit code or None when this script stopped it)."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
        status = None
        while status is None:
            if child.poll() is not None:
                status = "ran" if child.returncode == 0 else "failed"
            elif any(r.get("step") == steps for r in read_metrics(run_dir / "metrics.jsonl")):
                status = "ran"  # measured; what is left is the export of final/
            elif time.monotonic() > deadline:
                status = "stopped"
            else:
                time.sleep(0.5)
        wall = time.monotonic() - started
        code = child.returncode
        if code is None:
            os.killpg(child.pid, signal.SIGKILL)  # the child's own process group: its compiler children too
            child.wait()
    return status, wall, code


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steady numbers from metrics.jsonl: medians over the steps after the first WARMUP_STEPS."""
    steady = [r for r in records if r.get("step", 0) > WARMUP_STEPS] or records

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    def peak(key: str) -> float | None:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    return {
        "steps_logged": len(records),
        "steady_steps": [r["step"] for r in steady],
        "tokens_per_s": median("tokens_per_s"),
        "samples_per_s": median("samples_per_s"),
        "step_s": median("step_s"),
        "peak_gpu_gib": peak("gpu_peak_gib"),
        "peak_host_gib": peak("host_rss_gib"),
        "first_loss": records[0].get("loss") if records else None,
        "last_loss": records[-1].get("loss") if records else None,
        "skipped_steps": records[-1].get("skipped_steps") if records else None,
    }


def probe_from_log(text: str) -> dict[str, Any]:
    """What `--batch-size auto` said it chose (fitone/probe/api.py's lines)."""
    chose = re.search(r"--batch-size auto: micro-batch (\d+)(?: x (\d+) accumulation)?.*?largest fit (\d+)", text)
    took = re.search(r"probe done in ([\d.]+) s", text)
    return {
        "micro_batch": int(chose.group(1)) if chose else None,
        "grad_accum": int(chose.group(2) or 1) if chose else None,
        "probe_largest_fit": int(chose.group(3)) if chose else None,
        "probe_s": float(took.group(1)) if took else None,
    }


def padding(s: dict[str, Any], data: Path, pack: bool, micro_batch: int, micro_steps: int) -> dict[str, Any]:
    """The padding of the batches the run trained on: the same data, order and micro-batch, through fitone's
    own loading and batching. A packed row's padding is its tail after the last example (all labels
    ignored); unpacked, the attention mask says it."""
    from fitone.config import TrainConfig
    from fitone.data import IGNORE_INDEX, batches, load_dataset
    from fitone.models import CAUSAL, load_config, load_tokenizer

    cfg = TrainConfig(model=s["model"], from_scratch=True, data=str(data), seq_len=s["seq_len"], pack=pack,
                      eval_examples=0)
    config = load_config(s["model"], from_scratch=True)
    tok = load_tokenizer(s["model"], config, from_scratch=True)
    dataset = load_dataset(cfg.data_settings(), CAUSAL, tok, config.vocab_size)
    stream = batches(dataset, micro_batch, seed=cfg.seed, pad_id=tok.pad_token_id)
    slots = pad = 0
    for _ in range(micro_steps):
        _, _, batch = next(stream)
        slots += batch["input_ids"].numel()
        if "attention_mask" in batch:
            pad += int((batch["attention_mask"] == 0).sum())
        else:
            for labels, positions in zip(batch["labels"], batch["position_ids"]):
                last = int((positions == 0).nonzero()[-1])  # where the row's last block starts
                if bool((labels[last:] == IGNORE_INDEX).all()):  # a 1-token example would count as padding
                    pad += len(labels) - last
    return {"padding_fraction": pad / slots, "rows_per_step": micro_batch, "tokens_per_row": slots / micro_steps
            / micro_batch, "examples": dataset.packed_from or len(dataset), "rows": len(dataset)}


def run_all(args: argparse.Namespace) -> int:
    s = setup()
    if args.examples:
        s["examples"] = args.examples
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    # one datasets cache for both children and the padding count: the text is tokenised once
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets-cache")
    began = time.monotonic()
    data = work / "longtail.jsonl"
    made = make_data(data, s)
    print(made["summary"], flush=True)
    records = []
    for name in RUNS:
        pack = name == "packed"
        run_dir = work / name
        command = train_command(s, data, run_dir, args.steps, pack)
        shown = shlex.join(["python3", *command[1:]]).replace(str(data), "longtail.jsonl").replace(str(run_dir), "RUN")
        record: dict[str, Any] = {"run": name, "pack": pack, "command": shown}
        left = args.budget_s - (time.monotonic() - began)
        if left < MIN_START_S:
            record.update(status="skipped", error=f"the {args.budget_s:.0f} s budget was spent")
            records.append(record)
            continue
        env = checkout_env(FITONE_CACHE_DIR=str(work / f"probe-cache-{name}"))  # a fresh probe for each run
        log_path = out / f"{name}.log"
        status, wall, code = run_child(command, env, run_dir, log_path, args.steps, time.monotonic() + left)
        metrics = read_metrics(run_dir / "metrics.jsonl")
        if metrics:
            (out / f"{name}-metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
        log = log_path.read_text(errors="replace")
        record.update(status=status, exit_code=code, wall_s=wall, **probe_from_log(log), **summarise(metrics))
        if record["micro_batch"] is None and metrics:  # a fixed --batch-size (the dry run): rows per step
            first = metrics[0]
            record.update(micro_batch=round(first["samples_per_s"] * first["step_s"]), grad_accum=1)
        if status == "failed":
            record["error"] = (log.strip().splitlines() or ["no output"])[-1]
        records.append(record)
    # after the runs, so that no run waits for it: a few seconds of loading the tokenised data again
    for record in records:
        if record.get("steps_logged") and record.get("micro_batch"):
            try:
                record.update(padding(s, data, record["pack"], record["micro_batch"],
                                      record["steps_logged"] * record["grad_accum"]))
            except Exception as exc:  # noqa: BLE001 - the speed numbers stand without it
                record["padding_error"] = f"{type(exc).__name__}: {exc}"
        print(line_for(record), flush=True)
    write_results(out, s, made, records, time.monotonic() - began, args)
    shutil.rmtree(work, ignore_errors=True)  # the data, caches and run folders: what counts is in OUT
    return 0 if all(r["status"] == "ran" for r in records) else 1


def machine() -> dict[str, Any]:
    return _machine(dry_run())


def line_for(r: dict[str, Any]) -> str:
    if r["status"] not in ("ran", "stopped"):
        return f"{r['run']}: {r['status']}: {r.get('error', '')}"
    fit = f" (largest fit {r['probe_largest_fit']})" if r.get("probe_largest_fit") else ""
    return (f"{r['run']}: {r['status']}, micro-batch {r.get('micro_batch')}{fit}, {r['steps_logged']} steps, "
            f"{_num(r['tokens_per_s'], ',.0f')} tokens/s, {_num(r['samples_per_s'], '.2f')} rows/s, padding "
            f"{_num(r.get('padding_fraction'), '.1%')}, peak GPU {_num(r['peak_gpu_gib'], '.1f')} GiB, "
            f"{r['wall_s']:.0f} s")


def write_results(out: Path, s: dict[str, Any], made: dict[str, Any], records: list[dict[str, Any]], wall_s: float,
                  args: argparse.Namespace) -> None:
    info = {**machine(), "wall_s": wall_s}
    by = {r["run"]: r for r in records}
    fast, slow = by["packed"].get("tokens_per_s"), by["unpacked"].get("tokens_per_s")
    ratio = fast / slow if fast and slow else None
    command = shlex.join(["python3", "scripts/bench_pack.py", "--out", "OUT", "--steps", str(args.steps),
                          "--budget-s", f"{args.budget_s:g}"])
    result = {"machine": info, "command": command, "setup": s, "data": made, "steps": args.steps,
              "packed_over_unpacked_tokens_per_s": ratio, "runs": records}
    (out / "pack.json").write_text(json.dumps(result, indent=2, default=str))
    rows = [
        "| run | status | micro-batch (largest fit) | probe s | steps | tokens/s | rows/s | padding "
        "| peak GPU GiB | peak host GiB | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["status"] in ("ran", "stopped"):
            rows.append(
                f"| {r['run']} | {r['status']} | {r.get('micro_batch') or '-'} ({r.get('probe_largest_fit') or '-'}) "
                f"| {_num(r.get('probe_s'), '.0f')} | {r['steps_logged']} | {_num(r['tokens_per_s'], ',.0f')} "
                f"| {_num(r['samples_per_s'], '.2f')} | {_num(r.get('padding_fraction'), '.1%')} "
                f"| {_num(r['peak_gpu_gib'], '.2f')} | {_num(r['peak_host_gib'], '.1f')} | {r['wall_s']:.0f} |"
            )
        else:
            rows.append(f"| {r['run']} | {r['status']}: {r.get('error', '')} | | | | | | | | | |")
    head = (
        f"# `--pack` against padded batches, long-tailed lengths: {info['gpu']}, {info['date']}, "
        f"commit {info['commit']}{' (DRY RUN on the CPU: a tiny model, not the benchmark)' if info['dry_run'] else ''}"
        f"\n\n`{command}` ({wall_s:.0f} s wall); torch {info['torch']}, transformers {info['transformers']}, "
        f"deepspeed {info['deepspeed']}.\n\nData: `{made['command']}` ({made['summary']}).\n\n"
        "Each run (tokens/s: loss tokens, no padding; median over steps "
        f"{WARMUP_STEPS + 1}..{args.steps}):\n\n"
        + "".join(f"    {r['command']}\n" for r in records)
        + "\n"
    )
    tail = f"\npacked / unpacked tokens/s: {_num(ratio, '.2f')}\n"
    (out / "pack.md").write_text(head + "\n".join(rows) + "\n" + tail)
    print("\n".join(rows) + "\n" + tail)
    print(f"wrote {out / 'pack.json'} and {out / 'pack.md'} ({wall_s:.0f} s)")


def main() -> int:
    return run_all(build_parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
