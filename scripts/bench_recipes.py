#!/usr/bin/env python3
"""Run every shipped GPU recipe as shipped, in one command, and record what each did.

Each recipe runs in its own child process, the way a user reproduces it offline:
    fitone train --recipe NAME model=<its folder> from_scratch=true data=synthetic batch_size=auto \\
        max_steps=STEPS eval_examples=0 out=null
so the probe picks the micro-batch (a fresh probe: FITONE_CACHE_DIR is a new folder) and every other
value (lengths, precision, offload, cap, accumulation) is the recipe's; eval_examples=0 and 4 steps keep the
call short. `out=null` writes no checkpoint
and no export (a t5-3b checkpoint is ~40 GB). Per recipe it records the probe's micro-batch (and its
largest fit), samples/s (and tokens/s for causal LMs), peak GPU, peak host RSS of the training loop and
of the whole process (probe included), or the one-line error a refusal gave, in OUT/recipes.json and
OUT/recipes.md, with each child's log in OUT/logs/.

On a CUDA machine (measured on one H200):
    python3 scripts/bench_recipes.py --out $OUT --recipes t5-large/24gb,t5-3b/80gb,gpt2-xl/16gb,t5-3b/24gb
took 440 s there, the CPU Adam build included (bench/results/2026-12-01-recipes/). Under a 10-minute
limit on one command, llama-7b/24gb (two 7B engine inits: ~5 minutes) runs in a command of its own
(`--recipes llama-7b/24gb`; it needs ~103 GiB of host RAM, which a 128 GiB machine has). A recipe that
would start after --budget-s (540 s) is recorded as skipped (rerun it with --recipes NAME).

On a CPU (a dry run of this script, not of the recipes): FITONE_RECIPES_DRY_RUN=1 runs two recipes with
the tiny model of their task, fp32, short lengths, micro-batch 2 and no GPU cap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import checkout_env, env_flag, machine as _machine  # and the checkout first on the path

# the two without offload first: they need no CPU Adam, which builds meanwhile (run_all); llama last (the
# most host RAM). The CPU recipe is the README's quick start, not run here.
ORDER = ["t5-large/24gb", "t5-3b/80gb", "gpt2-xl/16gb", "t5-3b/24gb", "llama-7b/24gb"]
DRY_RUN = ["t5-large/24gb", "gpt2-xl/16gb"]  # offload none (torch AdamW) and a causal LM with offload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--out", required=True, help="folder for recipes.json, recipes.md and logs/")
    p.add_argument("--recipes", help="comma-separated names (default: every GPU recipe)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per recipe (samples/s: median of 2..N)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="start no recipe after this many seconds; each child is stopped at the budget's end",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: run this recipe, write --result
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def dry_run() -> bool:
    return env_flag("FITONE_RECIPES_DRY_RUN")


def overrides_for(name: str, steps: int) -> dict[str, Any]:
    """The recipe as shipped, offline: its folder's shipped architecture, random tokens, the probe's batch."""
    from fitone.models import CAUSAL, load_config, task_of

    folder = name.split("/")[0]
    values: dict[str, Any] = {
        "model": folder,
        "from_scratch": True,
        "data": "synthetic",
        "batch_size": "auto",
        "max_steps": steps,
        "eval_examples": 0,
        "out": None,
        "progress": False,
    }
    if dry_run():
        causal = task_of(load_config(folder, from_scratch=True)) == CAUSAL
        values.update(
            model="gpt2-tiny" if causal else "t5-tiny",
            device="cpu",
            precision="fp32",
            max_gpu_memory=None,
            batch_size=2,
            global_batch=None,
            grad_accum=None,
        )
        values.update({"seq_len": 32} if causal else {"src_len": 8, "tgt_len": 8})
    return values


# -- the child: one recipe, in this process --------------------------------------------------------
def run_one(name: str, steps: int, result_path: Path) -> int:
    import resource

    import fitone
    from fitone.errors import FitoneError
    from fitone.models import CAUSAL, load_config, task_of
    from fitone.recipes import load_recipe
    from fitone.units import GIB

    record: dict[str, Any] = {"recipe": name}
    try:
        cfg = load_recipe(name).config(**overrides_for(name, steps))
        record.update(
            model=cfg.model,
            precision=cfg.precision,
            offload=cfg.offload,
            cap=cfg.max_gpu_memory,
            lengths={"seq_len": cfg.seq_len}
            if task_of(load_config(cfg.model, from_scratch=True)) == CAUSAL
            else {"src_len": cfg.src_len, "tgt_len": cfg.tgt_len},
        )
        result = fitone.train(cfg)
    except FitoneError as exc:  # a refusal (host RAM, cap) is a result too: the one line a user would read
        record.update(status="refused", error=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - recorded, and the exit code says so
        record.update(status="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    else:
        sps = result.samples_per_s
        seq = record["lengths"].get("seq_len")
        record.update(
            status="ran",
            micro_batch=result.micro_batch,
            grad_accum=result.grad_accum,
            steps=result.steps,
            update=result.update,
            samples_per_s=sps,
            tokens_per_s=sps * seq if sps and seq else None,
            peak_gpu_gib=result.peak_gpu_bytes / GIB,
            peak_host_train_gib=result.peak_host_rss_bytes / GIB,
            init_s=result.init_s,
            wall_s=result.wall_s,
            first_loss=result.losses[0] if result.losses else None,
            last_loss=result.final_loss,
            skipped_steps=result.skipped_steps,
        )
    # the process's high-water mark is at least any RSS the run sampled: the kernel keeps the two counts apart, and
    # getrusage's can lag psutil's by a few pages (a CI run read 0.50551 GiB against a sampled 0.50572)
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    record["peak_host_process_gib"] = max(high_water, record.get("peak_host_train_gib") or 0.0)
    result_path.write_text(json.dumps(record, indent=2, default=str))
    return {"ran": 0, "refused": 2}.get(record["status"], 1)


# -- the driver -------------------------------------------------------------------------------------
def run_all(args: argparse.Namespace) -> int:
    from fitone.recipes import recipe_names

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    shipped = [n for n in recipe_names() if re.fullmatch(r"\d+gb", n.split("/")[1])]
    names = (
        args.recipes.split(",")
        if args.recipes
        else DRY_RUN
        if dry_run()
        else [n for n in ORDER if n in shipped] + [n for n in shipped if n not in ORDER]
    )
    unknown = [n for n in names if n not in shipped]
    if unknown:
        raise SystemExit(
            f"bench_recipes: not a shipped GPU recipe: {', '.join(unknown)} (choose from {', '.join(shipped)})"
        )
    env = checkout_env(FITONE_CACHE_DIR=tempfile.mkdtemp(prefix="run-recipes-cache-"))  # a fresh probe per recipe
    began = time.monotonic()
    # DeepSpeed's CPU Adam is JIT-compiled once per fresh machine (~50 s on the H200, README): on the CPU
    # cores, while the recipes without offload use the GPU, instead of inside the first offloaded recipe
    with open(out / "logs" / "cpu-adam-build.log", "w") as log:
        code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
        build = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    records = []
    for name in names:
        left = args.budget_s - (time.monotonic() - began)
        slug = name.replace("/", "-")
        if left < 30:
            records.append(
                {
                    "recipe": name,
                    "status": "skipped",
                    "error": f"the {args.budget_s:.0f} s budget was spent; "
                    f"run it alone: scripts/bench_recipes.py --out DIR --recipes {name}",
                }
            )
            continue
        result_path = out / "logs" / f"{slug}.json"
        command = [
            sys.executable,
            __file__,
            "--out",
            str(out),
            "--one",
            name,
            "--steps",
            str(args.steps),
            "--result",
            str(result_path),
        ]
        started = time.monotonic()
        with open(out / "logs" / f"{slug}.log", "w") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                child.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # the child's own process group: its compiler children too
                child.wait()
        record = (
            json.loads(result_path.read_text())
            if result_path.is_file()
            else {
                "recipe": name,
                "status": "failed",
                "error": f"no result (exit {child.returncode}; "
                f"{'stopped at the budget' if child.returncode == -9 else 'see the log'})",
            }
        )
        record["process_s"] = time.monotonic() - started
        fit = re.search(r"largest fit (\d+)", (out / "logs" / f"{slug}.log").read_text(errors="replace"))
        record["probe_largest_fit"] = int(fit.group(1)) if fit else None
        records.append(record)
        print(line_for(record), flush=True)
    if build.poll() is None:
        os.killpg(build.pid, signal.SIGKILL)
    write_results(out, records, time.monotonic() - began)
    return 0 if all(r["status"] in ("ran", "refused") for r in records) else 1


def machine() -> dict[str, Any]:
    return _machine(dry_run())


def line_for(r: dict[str, Any]) -> str:
    if r["status"] != "ran":
        return f"{r['recipe']}: {r['status']}: {r.get('error', '')}"
    speed = f"{r['samples_per_s']:.1f} samples/s" + (
        f" ({r['tokens_per_s']:,.0f} tokens/s)" if r.get("tokens_per_s") else ""
    )
    fit = f" (largest fit {r['probe_largest_fit']})" if r.get("probe_largest_fit") else ""
    return (
        f"{r['recipe']}: micro-batch {r['micro_batch']}{fit} x {r['grad_accum']} accumulation, {speed}, "
        f"peak GPU {r['peak_gpu_gib']:.1f} GiB, peak host {r['peak_host_train_gib']:.1f} GiB "
        f"(process {r['peak_host_process_gib']:.1f}), {r['update']} step"
    )


def write_results(out: Path, records: list[dict[str, Any]], wall_s: float) -> None:
    info = {**machine(), "wall_s": wall_s}
    (out / "recipes.json").write_text(json.dumps({"machine": info, "recipes": records}, indent=2, default=str))
    header = (
        "| recipe | status | micro-batch (largest fit) | samples/s | tokens/s | peak GPU GiB "
        "| peak host GiB (train / process) | step |"
    )
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["status"] == "ran":
            tokens = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
            rows.append(
                f"| {r['recipe']} | ran {r['steps']} steps | {r['micro_batch']} ({r.get('probe_largest_fit') or '-'}) "
                f"| {r['samples_per_s']:.1f} | {tokens} | {r['peak_gpu_gib']:.2f} "
                f"| {r['peak_host_train_gib']:.1f} / {r['peak_host_process_gib']:.1f} | {r['update']} |"
            )
        else:
            rows.append(f"| {r['recipe']} | {r['status']}: {r.get('error', '')} | | | | | | |")
    head = (
        f"# Shipped recipes as shipped: {info['gpu']}, {info['date']}, commit {info['commit']}"
        f"{' (DRY RUN on the CPU: tiny models, not the recipes)' if info['dry_run'] else ''}\n\n"
        f"`python3 scripts/bench_recipes.py --out OUT` ({wall_s:.0f} s wall); torch {info['torch']}, "
        f"deepspeed {info['deepspeed']}.\n\n"
    )
    (out / "recipes.md").write_text(head + "\n".join(rows) + "\n")
    print(f"wrote {out / 'recipes.json'} and {out / 'recipes.md'} ({wall_s:.0f} s)")


def main() -> int:
    args = build_parser().parse_args()
    if args.one:
        return run_one(args.one, args.steps, Path(args.result))
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
