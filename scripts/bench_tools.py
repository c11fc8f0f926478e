#!/usr/bin/env python3
"""The tool comparison: fitone, a hand-written DeepSpeed loop, HF Trainer and plain PyTorch, side by side.

Same model, data shape, precision and memory cap for every tool. Each tool x micro-batch runs in its
own child process (an OOM or a leaked engine cannot poison the next measurement, and peak host RSS
is per run); the parent collects one JSON record per run, rewrites the results file after every
child (a timeout keeps what finished) and prints a table at the end. See bench/README.md.

    python scripts/bench_tools.py                       # t5-3b, fp16, 23GiB cap, batches 8,64,256, all tools
    python scripts/bench_tools.py --quick               # t5-large, two sizes, fitone + deepspeed, < 3 min
    python scripts/bench_tools.py --device cpu --tools deepspeed,torch-plain --batch-sizes 2 --steps 2
    python scripts/bench_tools.py --tools hf-trainer-auto-find --auto-find-start 320
    python scripts/bench_tools.py --model llama-7b --precision bf16 --seq-len 512 --batch-sizes 8 \
        --tools fitone,deepspeed --ds-param-groups 16 --grad-accum 1,4   # a causal LM, issue 19's speed bar

Timing: every step is bracketed by torch.cuda.synchronize(); warm-up steps come first (the DeepSpeed
loop also keeps warming while fp16 loss scaling still skips steps); `step_s` is the median of the
timed steps that were not skipped, `step_s_spread` their [min, max].

This file is the parent (plan the runs, start one child per run, collect records); a child runs
_tools_child.child_main, which measures with _tools_measure (fitone, the DeepSpeed loop, plain PyTorch) or
_tools_hf (HF Trainer). Formerly scripts/bench_gpu.py, with the same flags.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import (GIB, ROOT, child_env, command, gpu_name, load_records, model_task, resolve_out, stop_group,
                      write_json)
from _tools_child import PARTIAL, RECORD

__all__ = ["resolve_out"]  # the results file's name, tested here

# Each tool once: (name, runs under the --cap that stands for a smaller card, takes --grad-accum above 1,
# one engine/model serves every size under --same-process). A fitone variant is a row here and a few lines in
# _tools_measure.py.
TOOL_TABLE = (
    ("fitone", True, True, False),
    ("deepspeed", True, True, True),
    ("hf-trainer", True, False, False),
    ("torch-plain", True, False, True),
    ("torch-plain-uncapped", False, False, True),
    ("hf-trainer-auto-find", True, False, False),
    ("fitone-delayed", True, True, False),
    ("fitone-pipelined", True, True, False),
    ("fitone-deepspeed-step", True, True, False),
    ("fitone-widen-2m", True, True, False),
    ("fitone-widen-8m", True, True, False),
    ("fitone-speculative", True, True, False),
    ("fitone-share", True, True, False),
    ("fitone-speculative-share", True, True, False),
    ("fitone-host-cast", True, True, False),
)
TOOLS = tuple(name for name, *_ in TOOL_TABLE)
DEFAULT_TOOLS = TOOLS[:5]
CAPPED = {name for name, capped, _, _ in TOOL_TABLE if capped}
ACCUMULATING = {name for name, _, accumulating, _ in TOOL_TABLE if accumulating}  # the others' loops have none
REUSABLE = {name for name, _, _, reusable in TOOL_TABLE if reusable}
QUICK = {"model": "t5-large", "batch_sizes": [16, 64], "tools": ["fitone", "deepspeed"]}

# The fields every record has, in this order (measured ones are None where a run did not get that far).
# src_len/tgt_len are set for seq2seq models, seq_len for causal LMs; the other ones are None.
FIELDS = ("tool", "model", "params", "precision", "src_len", "tgt_len", "seq_len", "cap_gib", "batch_size",
          "grad_accum", "step_s", "step_s_spread", "samples_per_s", "tokens_per_s", "peak_gpu_gib", "peak_host_gib",
          "init_s", "oom", "error", "gpu", "date", "command")
LENGTHS = {"src_len": 128, "tgt_len": 128, "seq_len": 512}  # fitone's TrainConfig defaults (a test checks)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=None,
                   help=f"comma list of {', '.join(TOOLS)} (default: {','.join(DEFAULT_TOOLS)})")
    p.add_argument("--batch-sizes", default=None, help="comma list of micro-batches (default 8,64,256)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                   help="default fp16 (fp32 with --device cpu: DeepSpeed refuses fp16 on CPU)")
    p.add_argument("--model", default=None, help="shipped config name, built with random weights (default t5-3b)")
    p.add_argument("--src-len", type=int, default=None, help="seq2seq models: source tokens (default 128)")
    p.add_argument("--tgt-len", type=int, default=None, help="seq2seq models: target tokens (default 128)")
    p.add_argument("--seq-len", type=int, default=None, help="causal LMs: tokens per sequence (default fitone's 512)")
    p.add_argument("--grad-accum", default="1",
                   help="comma list: micro-batches per optimizer step, a run each (fitone: global_batch = micro x "
                        "K; deepspeed: gradient_accumulation_steps K); s/step and samples/s per optimizer step")
    p.add_argument("--ds-param-groups", type=int, default=1,
                   help="deepspeed tool: split the parameters into N consecutive optimizer groups of about equal "
                        "size (DeepSpeed flattens one group at a time, so its init needs less GPU memory)")
    p.add_argument("--cap", default="23GiB", help="GPU memory cap standing for a smaller card ('none': no cap)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median of them; use >= 5 on the GPU)")
    p.add_argument("--split-steps", type=int, default=1,
                   help="extra steps after the timed ones, with a sync around each part of the step, for the "
                        "forward/backward/transfer/CPU-Adam/upload split (0: no split)")
    p.add_argument("--profile", action="store_true",
                   help="fitone tools: one more step after the timed ones under torch.profiler, its Chrome trace "
                        "and kernel table beside the results (<out stem>-<tool>-b<size>.trace.json.gz / .table.txt)")
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['model']}, batches {QUICK['batch_sizes']}, tools {','.join(QUICK['tools'])}, "
                        "deepspeed in one process: a < 3 min check of a change")
    p.add_argument("--same-process", action="store_true",
                   help="deepspeed/torch-plain: run all sizes on one engine in one child (saves an engine init "
                        "per size); fitone and hf-trainer always get a child per size")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke run (tiny model, fp32)")
    p.add_argument("--out", default=None,
                   help="results JSON (appended to if it exists); a directory gets the default name "
                        "<date>-<gpu>.json (default bench/results/)")
    p.add_argument("--log-dir", nargs="?", const="auto", default=None,
                   help="keep each child's output here (no value: <out stem>-logs/ next to the JSON)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one child may run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run: children are cut to fit and later ones not started "
                        "(set it below a scheduler's time limit so the table still prints)")
    p.add_argument("--auto-find-start", type=int, default=None,
                   help="hf-trainer-auto-find: first batch size (default 1.25 x the largest --batch-sizes)")
    p.add_argument("--auto-find-timeout", type=float, default=300, help="seconds for hf-trainer-auto-find")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parsed flags with the --quick / --device cpu defaults filled in where the user gave none."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return args
    fill_defaults(args)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown tool {unknown[0]!r}; choose from {', '.join(TOOLS)}")
    args.batch_sizes = whole_numbers(parser, "--batch-sizes", args.batch_sizes, "8,64,256")
    if args.steps < 1 or args.warmup < 0 or args.split_steps < 0:
        parser.error("--steps must be >= 1, --warmup and --split-steps >= 0")
    check_device(parser, args)
    check_lengths(parser, args)
    args.grad_accum = whole_numbers(parser, "--grad-accum", str(args.grad_accum), "1 or 1,4")
    no_accum = [t for t in args.tools if t not in ACCUMULATING]
    if max(args.grad_accum) > 1 and no_accum:
        parser.error(f"--grad-accum above 1 is for the tools {', '.join(sorted(ACCUMULATING))}; "
                     f"drop {no_accum[0]!r} from --tools")
    if args.ds_param_groups < 1:
        parser.error("--ds-param-groups must be 1 or more")
    if args.auto_find_start is None:
        args.auto_find_start = max(args.batch_sizes) * 5 // 4
    return args


def fill_defaults(args: argparse.Namespace) -> None:
    """What --quick and --device cpu change where the user gave no value."""
    cpu = args.device == "cpu"
    if args.model is None:
        args.model = "t5-tiny" if cpu else QUICK["model"] if args.quick else "t5-3b"
    if args.precision is None:
        args.precision = "fp32" if cpu else "fp16"
    if args.batch_sizes is None:
        args.batch_sizes = ",".join(map(str, QUICK["batch_sizes"] if args.quick else [8, 64, 256]))
    if args.tools is None:
        args.tools = ",".join(QUICK["tools"] if args.quick else DEFAULT_TOOLS)
    if args.quick:
        args.same_process = True


def whole_numbers(parser: argparse.ArgumentParser, flag: str, text: str, example: str) -> list[int]:
    """A comma list of positive whole numbers, sorted and without repeats."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        parser.error(f"{flag} takes whole numbers, e.g. {example}")
    if not values or min(values) < 1:
        parser.error(f"{flag} needs at least one size of 1 or more")
    return values


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """fp16 and a GPU cap make no sense on the CPU; the cap must parse; few steps on a GPU are noisy."""
    cpu = args.device == "cpu"
    if cpu and args.precision == "fp16":
        parser.error("--device cpu cannot run fp16 (DeepSpeed refuses it): use --precision fp32 or bf16")
    args.cap = None if cpu or str(args.cap).lower() in ("none", "0", "") else args.cap
    if args.cap is not None:
        from fitone.errors import ConfigError
        from fitone.units import parse_size

        try:
            parse_size(args.cap, "--cap")
        except ConfigError as exc:
            parser.error(str(exc))
    if not cpu and args.steps < 5:
        print(f"bench: warning: --steps {args.steps}: a median of fewer than 5 steps is noisy", file=sys.stderr)


def check_lengths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set args.task and fill the lengths that model's kind uses: src/tgt for seq2seq, seq_len for causal
    (a seq_len beyond the model's positions is refused by the child, with fitone's message)."""
    try:
        args.task = model_task(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    given = [f"--{f.replace('_', '-')}" for f in LENGTHS if getattr(args, f) is not None]
    wrong = [f for f in given if (f == "--seq-len") != (args.task == "causal")]
    if wrong:
        use = "--seq-len" if args.task == "causal" else "--src-len/--tgt-len"
        parser.error(f"{wrong[0]} does not apply to {args.model} ({args.task}): use {use}")
    for name, value in LENGTHS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more")


def plan_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One job per child process: a tool, its accumulation and the batch sizes it runs, ascending."""
    jobs = []
    for tool in args.tools:
        sizes = list(args.batch_sizes)
        if tool == "hf-trainer-auto-find":
            sizes = [args.auto_find_start]
        elif tool == "torch-plain" and args.cap and 1 not in sizes:
            sizes = [1] + sizes  # the blog's claim: plain fp16 fails at batch 1 on a 24 GB card
        cap = args.cap if tool in CAPPED else None
        groups = [sizes] if args.same_process and tool in REUSABLE else [[b] for b in sizes]
        for accum in args.grad_accum:
            for group in groups:
                jobs.append({
                    "tool": tool, "sizes": group, "model": args.model, "task": args.task,
                    "precision": args.precision, "src_len": args.src_len, "tgt_len": args.tgt_len,
                    "seq_len": args.seq_len, "grad_accum": accum, "cap": cap, "warmup": args.warmup,
                    "steps": args.steps, "split_steps": args.split_steps, "device": args.device, "seed": args.seed,
                    "activation_checkpointing": args.activation_checkpointing,
                    "same_process": len(group) > 1,
                    **({"ds_param_groups": args.ds_param_groups} if tool == "deepspeed" else {}),
                    "timeout": args.auto_find_timeout if tool == "hf-trainer-auto-find" else args.timeout,
                })
    return jobs


def parse_child_output(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(final records, merged partial state) from a child's output lines."""
    records, partial = [], {}
    for line in text.splitlines():
        if line.startswith(RECORD):
            records.append(json.loads(line[len(RECORD):]))
        elif line.startswith(PARTIAL):
            partial.update(json.loads(line[len(PARTIAL):]))
    return records, partial


def run_job(job: dict[str, Any], timeout: float, log_path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Run one child to the end or the timeout. Returns its records, its last partial state, and a failure
    note ('' when it exited cleanly)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    with open(log_path, "w") as log:
        # its own process group (a timeout kills its helpers too), but not a new session: whoever ends this
        # run's session (a scheduler at its time limit) must end the child with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(),
                                process_group=0)
        failure = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            failure = f"timeout after {timeout:.0f} s"
        finally:
            if proc.poll() is None:
                stop_group(proc)
    text = log_path.read_text(errors="replace")
    records, partial = parse_child_output(text)
    if not failure and proc.returncode != 0:
        failure = f"exit code {proc.returncode}" + (
            " (killed without a traceback: host RAM ran out?)" if proc.returncode in (-9, 137) else "")
    return records, partial, failure


def base_record(job: dict[str, Any], size: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """The fields the parent knows before a child runs; measured ones start as None."""
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    cap_gib = None
    if job["cap"]:
        from fitone.units import parse_size

        cap_gib = round(parse_size(job["cap"]) / GIB, 2)
    causal = job.get("task") == "causal"
    rec.update(tool=job["tool"], model=job["model"], precision=job["precision"],
               src_len=None if causal else job["src_len"], tgt_len=None if causal else job["tgt_len"],
               seq_len=job["seq_len"] if causal else None, cap_gib=cap_gib, batch_size=size,
               grad_accum=job.get("grad_accum", 1), oom=False, gpu=ctx["gpu"], date=ctx["date"],
               command=ctx["command"], device=job["device"], warmup=job["warmup"], steps=job["steps"],
               activation_checkpointing=job["activation_checkpointing"])
    if "ds_param_groups" in job:
        rec["ds_param_groups"] = job["ds_param_groups"]
    return rec


def tokens_per_sample(rec: dict[str, Any]) -> int | None:
    """Tokens one sequence carries: seq_len for a causal LM, source + target for seq2seq."""
    if rec.get("seq_len"):
        return rec["seq_len"]
    if rec.get("src_len") and rec.get("tgt_len"):
        return rec["src_len"] + rec["tgt_len"]
    return None


def tail(text: str, n: int = 15) -> str:
    """The last lines of a child's output, without its heartbeat and record lines."""
    lines = [line for line in text.rstrip().splitlines() if not line.startswith((PARTIAL, RECORD))]
    return "\n".join(lines[-n:])


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler's time limit): stop the child, keep what finished


def main(argv: list[str] | None = None) -> int:
    script = "scripts/bench_tools.py"
    if argv is None:
        argv, script = sys.argv[1:], os.path.relpath(Path(__file__).resolve(), Path.cwd())
    argv = list(argv)
    args = parse_args(argv)
    if args.child:
        from _tools_child import child_main

        code = child_main(json.loads(args.child))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # records are out; skip teardown, where a dead NCCL group or engine thread can hang
    now = dt.datetime.now(dt.timezone.utc)
    gpu = gpu_name(args.device)
    out = resolve_out(args.out, gpu, now.strftime("%Y-%m-%d"))
    ctx = {"gpu": gpu, "date": now.strftime("%Y-%m-%d"), "command": command(script, argv)}
    log_dir = None
    if args.log_dir:
        log_dir = out.parent / f"{out.stem}-logs" if args.log_dir == "auto" else Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = plan_jobs(args)
    for job in jobs if args.profile else []:
        if job["tool"].startswith("fitone"):
            job["profile"] = str(out.parent / f"{out.stem}-{job['tool']}-b{'-'.join(map(str, job['sizes']))}")
    print(f"bench: {len(jobs)} child runs of {args.model} {args.precision} on {gpu}, cap {args.cap}; "
          f"results -> {out}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    new, interrupted = run_jobs(jobs, ctx, out, log_dir, args.budget)
    # the run's whole time (--quick promises < 3 min)
    print(f"\nbench: {len(new)} records written to {out} in {time.monotonic() - t0:.0f} s\n")
    from bench_table import render

    print(render(new))
    return 1 if interrupted or any(r.get("error") for r in new) else 0


def run_jobs(jobs: list[dict[str, Any]], ctx: dict[str, Any], out: Path, log_dir: Path | None,
             budget: float | None) -> tuple[list[dict[str, Any]], bool]:
    """Run the jobs in order, appending their records to `out` after each. Returns (new records, interrupted)."""
    started = time.monotonic()
    records = load_records(out)
    new: list[dict[str, Any]] = []
    oom_at: dict[tuple[str, int], int] = {}  # (tool, accum) -> smallest size that did not fit; larger ones not run
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        for job in jobs:
            sizes, tool = job["sizes"], job["tool"]
            key = (tool, job.get("grad_accum", 1))
            timeout = job["timeout"]
            left = None if budget is None else budget - (time.monotonic() - started)
            if key in oom_at:
                skip = {"oom": True, "note": f"not run: batch {oom_at[key]} already ran out of memory"}
            elif left is not None and left < 30:
                skip = {"error": "not run: --budget spent"}
            else:
                skip = None
            if skip:
                new += [{**base_record(job, size, ctx), **skip} for size in sizes]
                write_json(out, records + new)
                continue
            if left is not None:
                timeout = min(timeout, left - 10)
            accum = f"-a{key[1]}" if key[1] > 1 else ""
            log_path = (log_dir or Path(tmp)) / f"{tool}-b{'-'.join(map(str, sizes))}{accum}.log"
            print(f"bench: {tool} batch {','.join(map(str, sizes))}"
                  f"{f' x {key[1]} micro-batches a step' if accum else ''} ...", flush=True)
            t0 = time.monotonic()
            interrupted = False
            try:
                got, partial, failure = run_job(job, timeout, log_path)
            except KeyboardInterrupt:
                got, partial = parse_child_output(log_path.read_text(errors="replace"))
                failure, interrupted = "interrupted (SIGTERM or Ctrl-C)", True
            done = collect(job, ctx, got, partial, failure, timeout)
            for rec in done:
                if rec.get("oom"):
                    oom_at[key] = min(oom_at.get(key, rec["batch_size"]), rec["batch_size"])
                print("  " + one_line(rec), flush=True)
            if failure or any(r.get("error") for r in done):
                print(f"  child output ({time.monotonic() - t0:.0f} s), last lines:\n" +
                      tail(log_path.read_text(errors="replace")), flush=True)
            new += done
            write_json(out, records + new)
            if interrupted:
                return new, True
    return new, False


def collect(job: dict[str, Any], ctx: dict[str, Any], got: list[dict[str, Any]], partial: dict[str, Any],
            failure: str, timeout: float) -> list[dict[str, Any]]:
    """One record per size of the job: the child's, or what its partial lines and exit tell."""
    by_size = {r.get("batch_size"): r for r in got}
    out = []
    for size in job["sizes"]:
        rec = base_record(job, size, ctx)
        if size in by_size:
            rec.update(by_size[size])
        else:  # the child died, timed out, or stopped at a smaller size that ran out of memory
            rec.update({k: v for k, v in partial.items() if k not in ("batch_size", "started", "phase")})
            if any(r.get("oom") for r in got):
                rec.update(oom=True, note="not run: a smaller batch already ran out of memory")
            elif job["tool"] == "hf-trainer-auto-find" and failure.startswith("timeout"):
                rec.update(outcome=f"still searching after {timeout:.0f} s (stopped by the harness)")
            else:
                rec["error"] = failure or "the child printed no record"
                if partial.get("phase"):
                    rec["error"] += f" during {partial['phase']}"
        tokens = tokens_per_sample(rec)
        if rec.get("samples_per_s") is not None and tokens:
            rec["tokens_per_s"] = round(rec["samples_per_s"] * tokens, 1)
        out.append(rec)
    return out


def one_line(rec: dict[str, Any]) -> str:
    accum = rec.get("grad_accum") or 1
    head = f"{rec['tool']} b={rec['batch_size']}{f' x{accum}' if accum > 1 else ''}: "
    if rec.get("error"):
        return head + "ERROR " + str(rec["error"]).splitlines()[0][:200]
    if rec.get("oom"):
        return head + "OOM " + (rec.get("note") or str(rec.get("oom_message") or "")[:160])
    if rec.get("outcome"):
        return head + str(rec["outcome"])
    def num(key: str, fmt: str) -> str:
        return "?" if rec.get(key) is None else format(rec[key], fmt)

    tokens = f"{num('tokens_per_s', ',.0f')} tokens/s, " if rec.get("seq_len") else ""
    return (head + f"{num('step_s', '.3f')} s/step, {num('samples_per_s', '.1f')} samples/s, {tokens}"
            f"GPU {num('peak_gpu_gib', '.2f')} GiB, host {num('peak_host_gib', '.1f')} GiB, "
            f"init {num('init_s', '.1f')} s")


if __name__ == "__main__":
    sys.exit(main())
