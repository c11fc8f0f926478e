#!/usr/bin/env python3
"""GPU benchmark: fitone, a hand-written DeepSpeed loop, HF Trainer and plain PyTorch, side by side.

Same model, data shape, precision and memory cap for every tool. Each tool x micro-batch runs in its
own child process (an OOM or a leaked engine cannot poison the next measurement, and peak host RSS
is per run); the parent collects one JSON record per run, rewrites the results file after every
child (a timeout keeps what finished) and prints a table at the end. See bench/README.md.

    python scripts/bench_gpu.py                       # t5-3b, fp16, 23GiB cap, batches 8,64,256, all tools
    python scripts/bench_gpu.py --quick               # t5-large, two sizes, fitone + deepspeed, < 3 min
    python scripts/bench_gpu.py --device cpu --tools deepspeed,torch-plain --batch-sizes 2 --steps 2
    python scripts/bench_gpu.py --tools hf-trainer-auto-find --auto-find-start 320
    python scripts/bench_gpu.py --model llama-7b --precision bf16 --seq-len 512 --batch-sizes 8 \
        --tools fitone,deepspeed --ds-param-groups 16 --grad-accum 1,4   # a causal LM, issue 19's speed bar

Timing: every step is bracketed by torch.cuda.synchronize(); warm-up steps come first (the DeepSpeed
loop also keeps warming while fp16 loss scaling still skips steps); `step_s` is the median of the
timed steps that were not skipped, `step_s_spread` their [min, max].
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3  # = fitone.units.GIB; importing fitone here would load torch in the parent, which only schedules

TOOLS = ("fitone", "deepspeed", "hf-trainer", "torch-plain", "torch-plain-uncapped", "hf-trainer-auto-find",
         "fitone-delayed", "fitone-pipelined", "fitone-deepspeed-step")
DEFAULT_TOOLS = TOOLS[:5]
REUSABLE = {"deepspeed", "torch-plain", "torch-plain-uncapped"}  # one engine/model serves every size (--same-process)
CAPPED = {"fitone", "deepspeed", "hf-trainer", "torch-plain", "hf-trainer-auto-find", "fitone-delayed",
          "fitone-pipelined", "fitone-deepspeed-step"}
# fitone with these options (`fitone` alone: its defaults, the pipelined update on one GPU)
FITONE_VARIANTS = {"fitone-delayed": {"delayed_update": True, "delayed_update_after": 1},
                   "fitone-pipelined": {"pipelined_update": True},
                   "fitone-deepspeed-step": {"pipelined_update": False}}
RECORD = "BENCH_RECORD "  # a child's final record for one batch size, one JSON object per line
PARTIAL = "BENCH_PARTIAL "  # what a child knows so far; kept when it dies or times out
QUICK = {"model": "t5-large", "batch_sizes": [16, 64], "tools": ["fitone", "deepspeed"]}

# The fields every record has, in this order (measured ones are None where a run did not get that far).
# src_len/tgt_len are set for seq2seq models, seq_len for causal LMs; the other ones are None.
FIELDS = ("tool", "model", "params", "precision", "src_len", "tgt_len", "seq_len", "cap_gib", "batch_size",
          "grad_accum", "step_s", "step_s_spread", "samples_per_s", "tokens_per_s", "peak_gpu_gib", "peak_host_gib",
          "init_s", "oom", "error", "gpu", "date", "command")
# tools that take --grad-accum above 1 (the others' loops have no accumulation)
ACCUMULATING = {"deepspeed", "fitone", *FITONE_VARIANTS}
LENGTHS = {"src_len": 128, "tgt_len": 128, "seq_len": 512}  # fitone's TrainConfig defaults (a test checks)
HEARTBEAT_S = 10  # how often a child reports its host RSS, so one killed by the kernel still says how far it got


# ================================================================================================
# parent: plan the runs, start one child per run, collect records
# ================================================================================================

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
                        "(set it below the device tool's limit so the table still prints)")
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
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown tool {unknown[0]!r}; choose from {', '.join(TOOLS)}")
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        parser.error("--batch-sizes takes whole numbers, e.g. 8,64,256")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes needs at least one positive size")
    if args.steps < 1 or args.warmup < 0 or args.split_steps < 0:
        parser.error("--steps must be >= 1, --warmup and --split-steps >= 0")
    if cpu and args.precision == "fp16":
        parser.error("--device cpu cannot run fp16 (DeepSpeed refuses it): use --precision fp32 or bf16")
    args.cap = None if cpu or str(args.cap).lower() in ("none", "0", "") else args.cap
    if args.cap is not None:
        from fitone.units import parse_size
        from fitone.errors import ConfigError

        try:
            parse_size(args.cap, "--cap")
        except ConfigError as exc:
            parser.error(str(exc))
    if not cpu and args.steps < 5:
        print(f"bench: warning: --steps {args.steps}: a median of fewer than 5 steps is noisy", file=sys.stderr)
    check_lengths(parser, args)
    try:
        args.grad_accum = sorted({int(k) for k in str(args.grad_accum).split(",") if k.strip()})
    except ValueError:
        parser.error("--grad-accum takes whole numbers, e.g. 1 or 1,4")
    if not args.grad_accum or min(args.grad_accum) < 1:
        parser.error("--grad-accum needs at least one size of 1 or more")
    no_accum = [t for t in args.tools if t not in ACCUMULATING]
    if max(args.grad_accum) > 1 and no_accum:
        parser.error(f"--grad-accum above 1 is for the tools {', '.join(sorted(ACCUMULATING))}; "
                     f"drop {no_accum[0]!r} from --tools")
    if args.ds_param_groups < 1:
        parser.error("--ds-param-groups must be 1 or more")
    if args.auto_find_start is None:
        args.auto_find_start = max(args.batch_sizes) * 5 // 4
    return args


def model_task(model: str) -> str:
    """'causal' or 'seq2seq' (fitone.models' names) from the model's config file. The parent reads the JSON
    itself: importing transformers (and torch) here costs tens of seconds on a busy machine. What the file
    does not settle goes through fitone.models (ValueError with its message if it cannot load it)."""
    for path in (ROOT / "fitone" / "model_configs" / f"{model}.json", Path(model, "config.json")):
        if path.is_file():
            values = json.loads(path.read_text())
            if "is_encoder_decoder" in values:
                return "seq2seq" if values["is_encoder_decoder"] else "causal"
            names = values.get("architectures") or []
            if names and all(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
                return "causal"
            break
    from fitone.errors import FitoneError
    from fitone.models import load_config, task_of

    try:
        return task_of(load_config(model, from_scratch=True))
    except FitoneError as exc:
        raise ValueError(str(exc)) from exc


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


def gpu_name(device: str) -> str:
    """The GPU's name without creating a CUDA context in the parent (nvidia-smi, else a throwaway child)."""
    if device == "cpu":
        return "cpu"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[-1]
    return "unknown-gpu"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def resolve_out(out: str | None, gpu: str, date: str) -> Path:
    """The results file: --out as given, or <date>-<gpu>.json inside --out (a directory) or bench/results/."""
    name = f"{date}-{slug(gpu)}.json"
    if out is None:
        return ROOT / "bench" / "results" / name
    path = Path(out)
    if out.endswith(os.sep) or path.is_dir():
        return path / name
    return path


def load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise SystemExit(f"{path} does not hold a list of records; give another --out")
    return data


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite the whole list through a temporary file, so a kill mid-write leaves the last good file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """What DeepSpeed needs to run without its launcher (one rank), and the checkout on the path."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


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
        # run's session (the device tool at its time limit) must end the child with it
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


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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
    raise KeyboardInterrupt  # SIGTERM (the device tool's time limit): stop the child, keep what finished


def main(argv: list[str] | None = None) -> int:
    script = "scripts/bench_gpu.py"
    if argv is None:
        argv, script = sys.argv[1:], os.path.relpath(Path(__file__).resolve(), Path.cwd())
    argv = list(argv)
    args = parse_args(argv)
    if args.child:
        code = child_main(json.loads(args.child))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # records are out; skip teardown, where a dead NCCL group or engine thread can hang
    now = dt.datetime.now(dt.timezone.utc)
    gpu = gpu_name(args.device)
    out = resolve_out(args.out, gpu, now.strftime("%Y-%m-%d"))
    ctx = {"gpu": gpu, "date": now.strftime("%Y-%m-%d"), "command": shlex.join(["python", script, *argv])}
    log_dir = None
    if args.log_dir:
        log_dir = out.parent / f"{out.stem}-logs" if args.log_dir == "auto" else Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = plan_jobs(args)
    print(f"bench: {len(jobs)} child runs of {args.model} {args.precision} on {gpu}, cap {args.cap}; "
          f"results -> {out}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    new, interrupted = run_jobs(jobs, ctx, out, log_dir, args.budget)
    # the run's whole time (what a device call spends on it; --quick promises < 3 min)
    print(f"\nbench: {len(new)} records written to {out} in {time.monotonic() - t0:.0f} s\n")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
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
                write_records(out, records + new)
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
            write_records(out, records + new)
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


# ================================================================================================
# child: measure one tool at one (or, with --same-process, several) batch sizes
# ================================================================================================

_EMIT_LOCK = threading.Lock()


def emit(prefix: str, values: dict[str, Any]) -> None:
    """One whole line per record: the heartbeat thread emits too, and print() writes the text and its
    newline separately, so two threads' lines could interleave and break the parent's JSON parsing."""
    line = prefix + json.dumps(values, default=str) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def child_main(job: dict[str, Any]) -> int:
    """Run the job's tool, print one RECORD line per batch size. Errors become records, not tracebacks only."""
    sys.path.insert(0, str(ROOT))
    emit(PARTIAL, {"started": time.time()})
    start_heartbeat()
    measure = {"fitone": measure_fitone, "fitone-delayed": measure_fitone, "fitone-pipelined": measure_fitone,
               "fitone-deepspeed-step": measure_fitone,
               "deepspeed": measure_deepspeed, "hf-trainer": measure_hf_trainer,
               "hf-trainer-auto-find": measure_hf_auto_find, "torch-plain": measure_torch,
               "torch-plain-uncapped": measure_torch}[job["tool"]]
    done: set[int] = set()
    try:
        for rec in measure(job):
            rec.update(environment())
            emit(RECORD, rec)
            done.add(rec["batch_size"])
    except Exception as exc:  # every failure must become a record the parent can show
        traceback.print_exc()
        for size in job["sizes"]:
            if size not in done:
                emit(RECORD, {"batch_size": size, **failure_fields(exc), **environment()})
                if failure_fields(exc)["oom"]:
                    break
    return 0


def start_heartbeat(every: float = HEARTBEAT_S) -> None:
    """Report this process's peak host RSS every few seconds (a daemon thread). A child the kernel kills for
    host memory prints nothing more, so its record keeps the last value seen (a lower bound) and the phase."""

    t0 = time.perf_counter()

    def beat() -> None:
        while True:
            time.sleep(every)
            with contextlib.suppress(Exception):
                emit(PARTIAL, {"peak_host_gib_last_seen": host_peak_gib(),
                               "last_seen_s": round(time.perf_counter() - t0, 1)})

    threading.Thread(target=beat, name="bench-heartbeat", daemon=True).start()


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """oom + its message for an out-of-memory error (also fitone's MemoryBudgetError), else error."""
    from fitone.memory import is_oom_error

    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0][:400]
    if is_oom_error(exc) or type(exc).__name__ == "MemoryBudgetError" or "out of memory" in text.lower():
        return {"oom": True, "oom_message": first}
    return {"oom": False, "error": first}


def environment() -> dict[str, Any]:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "accelerate"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"versions": versions, **({"gpu": gpu} if gpu else {})}


# -- shared measuring helpers ------------------------------------------------------------------

def syncer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def train_config(job: dict[str, Any], size: int, **extra: Any):
    """The fitone TrainConfig every tool shares (the DeepSpeed config and the batch come from it)."""
    from fitone.config import TrainConfig

    return TrainConfig(model=job["model"], from_scratch=True, data="synthetic", src_len=job["src_len"],
                       tgt_len=job["tgt_len"], seq_len=job["seq_len"], batch_size=size, precision=job["precision"],
                       max_gpu_memory=job["cap"], activation_checkpointing=job["activation_checkpointing"],
                       progress=True, out=None, seed=job["seed"], device=job["device"], **extra)  # the bar goes
    # to the child's log (stderr), so a child cut by --budget still shows the step it reached and its pace


def model_config(job: dict[str, Any]):
    """The model's config; a causal LM's seq_len beyond its positions is refused here, before any build."""
    from fitone.models import CAUSAL, check_seq_len, load_config, task_of

    config = load_config(job["model"], from_scratch=True)
    if task_of(config) == CAUSAL:
        check_seq_len(config, job["seq_len"], job["model"])
    return config


def param_count(config) -> int:
    from fitone.models import build_model

    return sum(p.numel() for p in build_model(config, meta=True).parameters())


def build_on_cpu(job: dict[str, Any], checkpointing: bool = True):
    """(model, config, params, build_s): the model from its shipped config on the CPU, seeded like every
    other tool's, with activation checkpointing switched on the way fitone does it (unless `checkpointing`
    is False: HF Trainer switches it on itself)."""
    import torch

    from fitone.models import build_model, enable_activation_checkpointing

    config = model_config(job)
    emit(PARTIAL, {"phase": "model build"})
    t0 = time.perf_counter()
    torch.manual_seed(job["seed"])
    model = build_model(config)
    if checkpointing and job["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    return model, config, sum(p.numel() for p in model.parameters()), round(time.perf_counter() - t0, 2)


def make_batch(job: dict[str, Any], config, size: int, device) -> dict[str, Any]:
    """One batch at the full lengths (random tokens), reused every step: shapes, not data, set the cost."""
    from fitone.data import worst_case_batch
    from fitone.models import task_of

    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    batch = worst_case_batch(task_of(config), size, train_config(job, size), config.vocab_size, pad)
    return {k: v.to(device) for k, v in batch.items()}


def cap_memory(job: dict[str, Any]) -> None:
    """Cap the CUDA allocator before the first allocation, as fitone's --max-gpu-memory does."""
    if job["cap"] and job["device"] == "cuda":
        from fitone.units import parse_size
        from fitone.memory import cap_gpu_memory

        cap_gpu_memory(parse_size(job["cap"]))


def reset_gpu_peak() -> None:
    from fitone.memory import reset_gpu_peak as reset

    reset()


def gpu_peak_gib() -> float:
    from fitone.memory import gpu_peak_bytes

    return round(gpu_peak_bytes() / GIB, 3)


def end_init() -> float:
    """The GPU peak of building the model/engine (GiB); then the peak restarts for the steps."""
    peak = gpu_peak_gib()
    reset_gpu_peak()
    return peak


def gpu_peaks() -> dict[str, float]:
    from fitone.memory import gpu_peak_bytes, gpu_reserved_peak_bytes

    return {"peak_gpu_gib": round(gpu_peak_bytes() / GIB, 3),
            "peak_gpu_reserved_gib": round(gpu_reserved_peak_bytes() / GIB, 3)}


def host_peak_gib() -> float:
    """Peak resident memory of this process so far (the kernel's high-water mark)."""
    import resource

    from fitone.memory import host_rss_bytes

    return round(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, host_rss_bytes()) / GIB, 3)


def load_cpu_adam() -> float:
    """Load (JIT-compiling on a fresh machine) DeepSpeed's CPU Adam op up front, so init_s leaves it out."""
    t0 = time.perf_counter()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    return round(time.perf_counter() - t0, 2)


def summarise(times: list[float], skipped: list[bool] | None, size: int) -> dict[str, Any]:
    """step_s = median of the timed steps that were not skipped (fp16 overflow), with their [min, max]."""
    skipped = skipped if skipped is not None and len(skipped) == len(times) else [False] * len(times)
    kept = [t for t, s in zip(times, skipped) if not s] or list(times)
    if not kept:
        return {"step_s": None, "step_s_spread": None, "samples_per_s": None, "step_times": []}
    step = statistics.median(kept)
    return {"step_s": round(step, 4), "step_s_spread": [round(min(kept), 4), round(max(kept), 4)],
            "samples_per_s": round(size / step, 2), "step_times": [round(t, 4) for t in times],
            "timed_skipped": sum(skipped), **({"warning": "every timed step was skipped (fp16 overflow)"}
                                              if all(skipped) and times else {})}


def median_parts(parts: list[dict[str, float]]) -> dict[str, float] | None:
    """Per-key median over steps (keys missing from a step count as 0 there)."""
    if not parts:
        return None
    keys = sorted({k for p in parts for k in p})
    return {k: round(statistics.median(p.get(k, 0.0) for p in parts), 4) for k in keys}


class Wrapper:
    """Swaps methods of live objects for timed versions (a sync on either side) and puts them back."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.times: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, name: str, label: str, after: Callable[[], None] | None = None) -> bool:
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn):
            return False
        sync, times = self.sync, self.times

        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                times[label] += time.perf_counter() - t0
                if after:
                    after()

        self._undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, timed)
        return True

    def restore(self) -> None:
        for obj, name, old in reversed(self._undo):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._undo.clear()


_MISSING = object()


class SyncTimers:
    """Stands in for DeepSpeed's ZeRO optimizer timers: synchronised wall-clock sums, never printed."""

    class _Timer:
        def __init__(self, owner: "SyncTimers", name: str):
            self.owner, self.name, self.t0 = owner, name, None

        def start(self) -> None:
            self.owner.sync()
            self.t0 = time.perf_counter()

        def stop(self, **_: Any) -> None:
            self.owner.sync()
            if self.t0 is not None:
                self.owner.times[self.name] += time.perf_counter() - self.t0
            self.t0 = None

        def reset(self) -> None:
            self.t0 = None

        def elapsed(self, **_: Any) -> float:
            return self.owner.times[self.name] * 1000

    def __init__(self, sync: Callable[[], None], times: dict[str, float]):
        self.sync, self.times, self._timers = sync, times, {}

    def __call__(self, name: str) -> "_Timer":
        return self._timers.setdefault(name, self._Timer(self, name))

    def log(self, *_: Any, **__: Any) -> None:
        pass

    def get_timers(self) -> dict[str, Any]:
        return self._timers

    def get_mean(self, *_: Any, **__: Any) -> None:
        return None


class EngineSplit:
    """Where a DeepSpeed engine's step goes, recorded per optimizer step.

    Every step: engine.forward / backward / step, each between CUDA syncs (`forward_s`, `backward_s`,
    `optimizer_s`) and whether fp16 loss scaling skipped it; with gradient accumulation each is summed over
    the step's micro-batches (engine.step runs after every backward and steps the optimizer at the last).
    From step `detail_from` on (the extra
    --split-steps, after the timed ones), also inside the ZeRO optimizer, each part between syncs:
    `grad_transfer_s` (reduce_ipg_grads: gradient buckets reduced and copied GPU -> CPU; in backward),
    `grad_norm_s` (scaled_global_norm), `unscale_clip_s` (timer optimizer_gradients), `cpu_adam_s`
    (_optimizer_step: DeepSpeedCPUAdam over the fp32 master), `param_upload_s` (timer optimizer_step
    minus cpu_adam_s: fp32 -> fp16 copy on the host and the host -> GPU copy), `allgather_s` (timer
    optimizer_allgather), `backward_compute_s` = backward_s - grad_transfer_s and `optimizer_other_s` =
    optimizer_s minus its listed parts. The detail syncs remove overlap, so detail steps are not timed.

    With fitone's overlapped update (it replaces `engine.optimizer.step` with its own bound method), a
    step during which an update completed also gets that update's host wall-clock counters (no syncs
    added; fitone.zero2.overlap's `last_timing`): `update_cpu_adam_s` (Adam in the background thread),
    `update_thread_s` (the thread's whole update: Adam, issuing the uploads) and `update_wait_s` (time
    the main thread blocked on it in forward / backward / the next step: an upper bound on the GPU's stall,
    since kernels already queued may still be running while the host waits).
    """

    def __init__(self, engine: Any, sync: Callable[[], None], detail_from: int | None):
        self.engine, self.sync, self.detail_from = engine, sync, detail_from
        self.init_peak_gib: float | None = None
        self.init_s: float | None = None  # deepspeed.initialize, when captured
        self.steps: list[dict[str, float]] = []
        self.skipped: list[bool] = []
        self.accum = 1
        with contextlib.suppress(Exception):
            self.accum = max(1, int(engine.gradient_accumulation_steps()))
        self._micro = 0  # engine.step calls since the last optimizer step
        self._global_steps = getattr(engine, "global_steps", None)  # DeepSpeed counts skipped steps too
        self.outer = Wrapper(sync)
        self.inner: Wrapper | None = None
        self._opt_timers = None
        self._last_update: dict[str, float] | None = None  # the overlapped update's timing already recorded
        self.outer.wrap(engine, "forward", "forward_s")
        self.outer.wrap(engine, "backward", "backward_s")
        self.outer.wrap(engine, "step", "optimizer_s", after=self._step_done)
        if detail_from is not None and detail_from <= 0:
            self._start_detail()

    def _step_done(self) -> None:
        self._micro += 1
        if not self._at_boundary():  # an accumulation micro-step: no optimizer step yet
            return
        self._micro = 0
        step = dict(self.outer.times)
        self.outer.times.clear()
        if self.inner is not None:
            step.update(self._detail(step))
        step.update(self._update_timing())
        self.steps.append(step)
        if hasattr(self.engine, "was_step_applied"):
            self.skipped.append(not self.engine.was_step_applied())
        else:
            self.skipped.append(bool(getattr(getattr(self.engine, "optimizer", None), "overflow", False)))
        if self.detail_from is not None and len(self.steps) == self.detail_from and self.inner is None:
            self._start_detail()

    def _at_boundary(self) -> bool:
        """Whether the engine.step that just returned stepped the optimizer: DeepSpeed's global_steps moved
        (skipped steps count too), or, where that counter does not move, this was the accum-th call."""
        steps = getattr(self.engine, "global_steps", None)
        moved = isinstance(steps, int) and steps != self._global_steps
        self._global_steps = steps
        return moved or self._micro >= self.accum

    def _update_timing(self) -> dict[str, float]:
        """The counters of the overlapped update that completed since the last step, if one did."""
        overlap = getattr(getattr(getattr(self.engine, "optimizer", None), "step", None), "__self__", None)
        timing = getattr(overlap, "last_timing", None)
        if not isinstance(timing, dict) or timing is self._last_update:
            return {}
        self._last_update = timing
        names = {"adam_s": "update_cpu_adam_s", "thread_s": "update_thread_s", "wait_s": "update_wait_s"}
        return {name: timing[k] for k, name in names.items() if k in timing}

    def _start_detail(self) -> None:
        opt = getattr(self.engine, "optimizer", None)
        if opt is None:
            return
        self.inner = Wrapper(self.sync)
        self.inner.wrap(opt, "reduce_ipg_grads", "grad_transfer_s")
        self.inner.wrap(opt, "scaled_global_norm", "grad_norm_s")
        self.inner.wrap(opt, "_optimizer_step", "cpu_adam_s")
        if hasattr(opt, "timers"):
            self._opt_timers = opt.timers
            opt.timers = SyncTimers(self.sync, self.inner.times)

    def _detail(self, step: dict[str, float]) -> dict[str, float]:
        t = dict(self.inner.times)
        self.inner.times.clear()
        out = {k: t[k] for k in ("grad_transfer_s", "grad_norm_s", "cpu_adam_s") if k in t}
        if "optimizer_gradients" in t:
            out["unscale_clip_s"] = t["optimizer_gradients"]
        if "optimizer_step" in t:
            out["param_upload_s"] = max(0.0, t["optimizer_step"] - t.get("cpu_adam_s", 0.0))
        if "optimizer_allgather" in t:
            out["allgather_s"] = t["optimizer_allgather"]
        if "backward_s" in step:
            out["backward_compute_s"] = max(0.0, step["backward_s"] - out.get("grad_transfer_s", 0.0))
        if "optimizer_s" in step:
            listed = sum(out.get(k, 0.0) for k in ("grad_norm_s", "unscale_clip_s", "cpu_adam_s", "param_upload_s",
                                                    "allgather_s"))
            out["optimizer_other_s"] = max(0.0, step["optimizer_s"] - listed)
        return out

    def restore(self) -> None:
        if self.inner is not None:
            self.inner.restore()
        if self._opt_timers is not None:
            self.engine.optimizer.timers = self._opt_timers
        self.outer.restore()

    def fields(self, first: int, last: int) -> dict[str, Any]:
        """split = medians of the timed steps [first, last) (the update_* keys over those that have them);
        split_detail = medians of the detail steps."""
        timed = [s for s, skip in zip(self.steps[first:last], self.skipped[first:last]) if not skip]
        coarse = [{k: v for k, v in s.items() if k in ("forward_s", "backward_s", "optimizer_s")} for s in timed]
        updates = [{k: v for k, v in s.items() if k.startswith("update_")} for s in timed]
        updates = [u for u in updates if u]
        detail = [s for s, skip in zip(self.steps[last:], self.skipped[last:]) if not skip]
        out: dict[str, Any] = {"peak_gpu_init_gib": self.init_peak_gib} if self.init_peak_gib is not None else {}
        if coarse:
            out["split"] = median_parts(coarse)
            if updates:
                out["split"].update(median_parts(updates))
        if detail:
            out["split_detail"] = median_parts(detail)
        elif self.steps[last:]:
            out["split_detail_note"] = "every detail step was skipped (fp16 overflow)"
        return out


@contextlib.contextmanager
def capture_engines(sync: Callable[[], None], detail_from: int | None) -> Iterator[list[EngineSplit]]:
    """Patch deepspeed.initialize so every engine built inside (by fitone or HF) gets an EngineSplit, and
    the GPU peak is read and restarted once the engine is built (split.init_peak_gib, then peak_gpu_gib
    over the steps: the same meaning for every tool). Inside a fitone Engine being built (capture_fitone_engine)
    the peak is only read: that wrapper restarts it once the whole Engine is built."""
    import deepspeed

    splits: list[EngineSplit] = []
    original = deepspeed.initialize

    def initialize(*a, **k):
        emit(PARTIAL, {"phase": "engine init"})
        t0 = time.perf_counter()
        result = original(*a, **k)
        init_s = time.perf_counter() - t0
        engine = result[0] if isinstance(result, tuple) else result
        if _BUILDING_FITONE_ENGINE:  # fitone's Engine is not built yet: its wrapper ends the init
            init_peak = gpu_peak_gib()
        else:
            init_peak = end_init()
            emit(PARTIAL, {"phase": "steps"})
        with contextlib.suppress(Exception):  # instrumentation must never break the tool under test
            splits.append(EngineSplit(engine, sync, detail_from))
            splits[-1].init_peak_gib, splits[-1].init_s = init_peak, init_s
        return result

    deepspeed.initialize = initialize
    try:
        yield splits
    finally:
        deepspeed.initialize = original


_BUILDING_FITONE_ENGINE: list[Any] = []  # non-empty while capture_fitone_engine's wrapper runs


@contextlib.contextmanager
def capture_fitone_engine(train_module: Any) -> Iterator[list[tuple[Any, float]]]:
    """Patch the Engine class `train_module` builds (fitone.train's name `Engine`, wherever it lives) to keep
    each instance with the GPU peak of its whole construction (GiB; fitone restarts the peak just before),
    then restart the peak for the steps. Yields nothing captured where train_module has no such class."""
    engines: list[tuple[Any, float]] = []
    cls = getattr(train_module, "Engine", None)
    if not isinstance(cls, type):
        yield engines
        return
    original, own = cls.__init__, "__init__" in cls.__dict__

    def __init__(self, *a, **k):
        _BUILDING_FITONE_ENGINE.append(self)
        try:
            original(self, *a, **k)
        finally:
            _BUILDING_FITONE_ENGINE.pop()
        engines.append((self, end_init()))
        emit(PARTIAL, {"phase": "steps"})

    cls.__init__ = __init__
    try:
        yield engines
    finally:
        if own:
            cls.__init__ = original
        else:
            del cls.__init__


# -- fitone ------------------------------------------------------------------------------------

def measure_fitone(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """fitone.train at one micro-batch; its own CUDA-synchronised step times, ours for the split.

    `fitone` runs fitone's defaults (on one GPU: the pipelined update); fitone-deepspeed-step /
    fitone-pipelined / fitone-delayed force DeepSpeed's step, the pipelined update, or the delayed update
    from the second step. The split detail only for DeepSpeed's step: an overlapped update's CPU work runs
    beside the next step's GPU work; its split has the update's own counters instead (update_cpu_adam_s,
    update_thread_s, update_wait_s: EngineSplit). With --grad-accum K, global_batch = micro x K: a step is
    K micro-batches. peak_gpu_init_gib is the harness's reading over fitone's whole Engine construction;
    engine_init_peak_gpu_gib fitone's own count where its Engine exposes one (init_peak_gpu_bytes).
    """
    import importlib

    from fitone.run import resolve_planned

    (size,) = job["sizes"]
    config = model_config(job)
    params = param_count(config)
    emit(PARTIAL, {"params": params})
    op_load_s = load_cpu_adam()
    sync = syncer(job["device"])
    warm, timed, extra = job["warmup"], job["steps"], job["split_steps"]
    options = dict(FITONE_VARIANTS.get(job["tool"], {}))
    accum = job.get("grad_accum", 1)
    if accum > 1:
        options["global_batch"] = size * accum
    mode = resolve_planned(train_config(job, size, **options), 1).mode.name  # the step training will take
    extra = extra if mode == "deepspeed" else 0
    detail_from = warm + timed if extra else None
    with capture_engines(sync, detail_from) as splits:  # before fitone.train is imported, so it sees the patch
        module = importlib.import_module("fitone.train")
        cfg = train_config(job, size, max_steps=warm + timed + extra, **options)
        with capture_fitone_engine(module) as engines:
            emit(PARTIAL, {"phase": "fitone setup (model build)"})
            t0 = time.perf_counter()
            result = module.train(cfg)
            wall = time.perf_counter() - t0
    split = splits[-1] if splits else None
    times = list(result.step_times)[warm:warm + timed]
    skipped = split.skipped[warm:warm + timed] if split and len(split.skipped) == len(result.step_times) else None
    rec = {"batch_size": size, "params": params, "op_load_s": op_load_s,
           **summarise(times, skipped, size * result.grad_accum),
           **gpu_peaks(),
           "peak_host_gib": round(max(result.peak_host_rss_bytes / GIB, host_peak_gib()), 3),
           "init_s": round(result.init_s, 2), "wall_s": round(wall, 2), "skipped_steps": result.skipped_steps,
           "grad_accum": result.grad_accum, "fitone_samples_per_s": round(result.samples_per_s, 2),
           "update": result.update, "delayed_update": result.update == "delayed",
           "pipelined_update": result.update == "pipelined",
           **loss_fields(list(result.losses))}
    if split:
        rec.update(split.fields(warm, warm + timed))
        split.restore()
    if engines:
        engine, rec["peak_gpu_init_gib"] = engines[-1]
        own = getattr(engine, "init_peak_gpu_bytes", None)
        rec["engine_init_peak_gpu_gib"] = round(own / GIB, 3) if own is not None else None
    yield rec


def loss_fields(losses: list[float]) -> dict[str, Any]:
    return {"loss_first": round(losses[0], 4) if losses else None,
            "loss_last": round(losses[-1], 4) if losses else None}


# -- deepspeed ---------------------------------------------------------------------------------

def measure_deepspeed(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A hand-written deepspeed.initialize loop with fitone's ZeRO-2 offload config (the blog's), as users
    write it. With several sizes (--same-process) one engine serves them all: ZeRO-2's buffers depend on
    the bucket sizes, not the micro-batch, so only the config's batch fields (unused here) differ.
    --ds-param-groups N hands deepspeed.initialize N parameter groups (split_param_groups) instead of one
    list; --grad-accum K sets gradient_accumulation_steps K and a step is K micro-batches."""
    import deepspeed

    from fitone.ds_config import build_ds_config
    from fitone.run import resolve_planned

    sizes, sync = job["sizes"], syncer(job["device"])
    accum = job.get("grad_accum", 1)
    op_load_s = load_cpu_adam()
    model, config, params, build_s = build_on_cpu(job)
    cap_memory(job)
    cfg = train_config(job, sizes[0], **({"global_batch": sizes[0] * accum} if accum > 1 else {}))
    ds = build_ds_config(resolve_planned(cfg, 1).with_batch(sizes[0]))  # the job's device (train_config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = split_param_groups(trainable, job.get("ds_param_groups", 1))
    # one group: the flat list, exactly as before the option existed
    model_parameters = trainable if len(groups) == 1 else [{"params": g} for g in groups]
    emit(PARTIAL, {"params": params, "build_s": round(build_s, 2), "op_load_s": op_load_s, "phase": "engine init",
                   "ds_param_groups": len(groups)})
    reset_gpu_peak()
    t0 = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model_parameters, config=ds)
    init_s = time.perf_counter() - t0
    init_peak = end_init()
    host_after_init = host_peak_gib()
    emit(PARTIAL, {"init_s": round(init_s, 2), "host_after_init_gib": host_after_init, "phase": "steps"})
    for size in sizes:
        base = {"batch_size": size, "params": params, "build_s": round(build_s, 2), "op_load_s": op_load_s,
                "init_s": round(init_s, 2), "host_after_init_gib": host_after_init, "peak_gpu_init_gib": init_peak,
                "grad_accum": accum, "ds_param_groups": len(groups),
                "ds_param_group_sizes": [sum(p.numel() for p in g) for g in groups],
                **({"init_shared": True} if size != sizes[0] else {})}
        try:
            batch = make_batch(job, config, size, engine.device)
            reset_gpu_peak()
            rec = run_ds_steps(engine, batch, size, job, sync)
        except Exception as exc:
            if not failure_fields(exc)["oom"]:
                raise
            yield {**base, **failure_fields(exc), **gpu_peaks(), "peak_host_gib": host_peak_gib()}
            return
        yield {**base, **rec, **gpu_peaks(), "peak_host_gib": host_peak_gib()}


def run_steps(one_step: Callable[[], bool], job: dict[str, Any],
              before_extra: Callable[[], None] | None = None) -> tuple[list[float], list[bool], int, int]:
    """Warm up; keep warming (up to 10 more steps) while fp16 loss scaling still skips steps; time `steps`
    steps; then run `split_steps` more after `before_extra`. `one_step` runs a step between syncs and
    returns whether it was skipped. Returns (step times, skipped flags, first timed, end of timed)."""
    times: list[float] = []
    skipped: list[bool] = []

    def timed_step() -> None:
        t0 = time.perf_counter()
        skipped.append(one_step())
        times.append(time.perf_counter() - t0)

    for _ in range(job["warmup"]):
        timed_step()
    for _ in range(10):
        if not (job["warmup"] and skipped and skipped[-1]):
            break
        timed_step()
    first = len(times)
    for _ in range(job["steps"]):
        timed_step()
    last = len(times)
    if job["split_steps"] and before_extra:
        before_extra()
        for _ in range(job["split_steps"]):
            timed_step()
    return times, skipped, first, last


def split_param_groups(params: list, n: int) -> list[list]:
    """`params` cut into min(n, len(params)) consecutive, non-empty groups of about equal numel: each group
    takes parameters while that brings it closer to an equal share of what is left."""
    n = max(1, min(n, len(params)))
    groups: list[list] = []
    i, left = 0, sum(p.numel() for p in params)
    for remaining in range(n, 0, -1):
        target = left / remaining
        group, size = [params[i]], params[i].numel()
        i += 1
        while i < len(params) - (remaining - 1) and (
                remaining == 1 or size + params[i].numel() - target <= target - size):
            group.append(params[i])
            size += params[i].numel()
            i += 1
        groups.append(group)
        left -= size
    return groups


def run_ds_steps(engine, batch: dict[str, Any], size: int, job: dict[str, Any], sync) -> dict[str, Any]:
    """The user's loop: forward, engine.backward, engine.step, timed between syncs; then the split's detail.
    With accumulation a step is `gradient_accumulation_steps` such micro-steps (engine.step after every
    backward, as DeepSpeed wants; it steps the optimizer at the last), timed as one; its loss their mean."""
    split = EngineSplit(engine, sync, detail_from=None)
    accum = job.get("grad_accum", 1)  # gradient_accumulation_steps in the engine's config
    losses: list[float] = []

    def one_step() -> bool:
        sync()
        total = 0.0
        for _ in range(accum):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total = total + loss.detach().float()
        sync()
        losses.append(float(total) / accum)
        return split.skipped[-1]

    def before_extra() -> None:
        split.detail_from = len(split.steps)
        split._start_detail()

    try:
        times, skipped, first, last = run_steps(one_step, job, before_extra)
    finally:
        split.restore()
    return {**summarise(times[first:last], skipped[first:last], size * accum), "warmup_used": first,
            "skipped_steps": sum(skipped), **split.fields(first, last), **loss_fields(losses)}


# -- HF Trainer --------------------------------------------------------------------------------

def hf_trainer(job: dict[str, Any], size: int, max_steps: int, callbacks: list, auto_find: bool, workdir: str):
    """A Seq2SeqTrainer over synthetic batches with `deepspeed=` fitone's config dict, set up the way its
    docs show (batch keys 'auto', so TrainingArguments fill them)."""
    import dataclasses

    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from fitone.ds_config import build_ds_config
    from fitone.run import resolve_planned

    model, config, params, _ = build_on_cpu(job, checkpointing=False)  # the Trainer switches it on
    cfg = train_config(job, size)
    ds = build_ds_config(resolve_planned(cfg, 1).with_batch(size))
    ds.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
    names = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    kwargs = dict(
        output_dir=workdir, per_device_train_batch_size=size, max_steps=max_steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        fp16=job["precision"] == "fp16", bf16=job["precision"] == "bf16", report_to="none", save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, deepspeed=ds,
        seed=job["seed"], auto_find_batch_size=auto_find, remove_unused_columns=False,
        use_cpu=job["device"] == "cpu",
        **{ckpt: job["activation_checkpointing"], f"{ckpt}_kwargs": {"use_reentrant": False}},
    )
    args = Seq2SeqTrainingArguments(**{k: v for k, v in kwargs.items() if k in names})  # older/newer names
    rows = make_batch(job, config, size, "cpu")
    dataset = RepeatRows(rows, size * (max_steps + 2))
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.dropped_args = sorted(k for k in kwargs if k not in names)
    return trainer, params


class RepeatRows:
    """A map-style dataset cycling the rows of one batch (the default collator stacks them back)."""

    def __init__(self, batch: dict[str, Any], length: int):
        self.batch, self.length = batch, length
        self.rows = next(iter(batch.values())).shape[0]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i % self.rows] for k, v in self.batch.items()}


def step_timer_callback(sync: Callable[[], None], on_begin: Callable[[Any], None] | None = None):
    """A TrainerCallback recording each optimizer step's synchronised wall time."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.first_step_at: float | None = None
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            if on_begin:
                on_begin(args)

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._t0 = time.perf_counter()
            if self.first_step_at is None:
                self.first_step_at = self._t0

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def measure_hf_trainer(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    (size,) = job["sizes"]
    warm, timed, extra = job["warmup"], job["steps"], job["split_steps"]
    sync = syncer(job["device"])
    op_load_s = load_cpu_adam()
    cap_memory(job)
    timer = step_timer_callback(sync)
    with tempfile.TemporaryDirectory() as workdir, capture_engines(sync, warm + timed if extra else None) as splits:
        t0 = time.perf_counter()
        trainer, params = hf_trainer(job, size, warm + timed + extra, [timer], False, workdir)
        setup_s = time.perf_counter() - t0
        dropped = trainer.dropped_args
        emit(PARTIAL, {"params": params, "build_s": round(setup_s, 2), "op_load_s": op_load_s, "phase": "train"})
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    setup_s = (timer.first_step_at - t0) if timer.first_step_at else None
    split = splits[-1] if splits else None
    init_s = split.init_s if split else setup_s
    skipped = split.skipped[warm:warm + timed] if split and len(split.skipped) == len(timer.times) else None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rec = {"batch_size": size, "params": params, "build_s": round(setup_s, 2), "op_load_s": op_load_s,
           **summarise(timer.times[warm:warm + timed], skipped, size), **gpu_peaks(),
           "peak_host_gib": host_peak_gib(), "init_s": round(init_s, 2) if init_s is not None else None,
           "train_setup_s": round(setup_s, 2) if setup_s is not None else None, "wall_s": round(wall, 2),
           "hf_args_dropped": dropped, **loss_fields(losses)}
    if split:
        rec.update(split.fields(warm, warm + timed))
        rec["skipped_steps"] = sum(split.skipped)
        split.restore()
    yield rec


def measure_hf_auto_find(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """HF Trainer's auto_find_batch_size from a start above the fitting size: what it ends with, and when.
    Each attempt is reported as it begins, so a harness timeout still says how far it got."""
    (start,) = job["sizes"]
    sync = syncer(job["device"])
    load_cpu_adam()
    cap_memory(job)
    attempts: list[int] = []
    t0 = time.perf_counter()

    def on_begin(args) -> None:
        timer.times.clear()  # a new attempt: only the last (successful) one's steps count
        # the Trainer shrinks its own _train_batch_size; args keep the start size
        attempts.append(int(getattr(trainer, "_train_batch_size", None) or args.per_device_train_batch_size))
        emit(PARTIAL, {"attempts": attempts, "elapsed_s": round(time.perf_counter() - t0, 1)})

    timer = step_timer_callback(sync, on_begin)
    rec: dict[str, Any] = {"batch_size": start}
    with tempfile.TemporaryDirectory() as workdir:
        trainer, params = hf_trainer(job, start, job["warmup"] + job["steps"], [timer], True, workdir)
        rec["params"] = params
        t0 = time.perf_counter()
        try:
            trainer.train()
            found = getattr(trainer, "_train_batch_size", None) or trainer.args.per_device_train_batch_size
            rec.update(outcome=f"trained at batch {found}", found_batch_size=found,
                       **summarise(timer.times[job["warmup"]:], None, found))
        except Exception as exc:  # giving up (or an OOM it let through) is the result measured
            if "executable batch size" not in str(exc) and not failure_fields(exc)["oom"]:
                raise  # anything else is a harness or setup error, reported as such
            rec.update(outcome=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                       found_batch_size=None)
    rec.update(elapsed_s=round(time.perf_counter() - t0, 1), attempts=attempts, **gpu_peaks(),
               peak_host_gib=host_peak_gib())
    # step_s/samples_per_s describe the found size; the record's batch_size stays the start size
    yield rec


# -- plain PyTorch -----------------------------------------------------------------------------

def measure_torch(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Plain PyTorch: fp32 weights, AdamW, autocast (fp16 with GradScaler, or bf16), all on the device.
    `torch-plain` under the cap (the blog's failing baseline), `torch-plain-uncapped` without (the ceiling)."""
    import torch

    sizes, device, sync = job["sizes"], job["device"], syncer(job["device"])
    base: dict[str, Any] = {"batch_size": sizes[0]}
    try:
        cap_memory(job)
        model, config, params, build_s = build_on_cpu(job)
        base.update(params=params, build_s=build_s)
        emit(PARTIAL, {"params": params, "build_s": build_s})
        t0 = time.perf_counter()
        reset_gpu_peak()
        model.to(device).train()
        cfg = train_config(job, sizes[0])  # the same lr / weight decay as the DeepSpeed config
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=cfg.weight_decay)
        init_s = round(time.perf_counter() - t0, 2)
        init_peak = end_init()
    except Exception as exc:  # an OOM while moving the weights is a result
        if not failure_fields(exc)["oom"]:
            raise
        yield {**base, **failure_fields(exc), "oom_phase": "init", **gpu_peaks(), "peak_host_gib": host_peak_gib()}
        return
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(job["precision"])
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)
    clip = cfg.grad_clip
    for size in sizes:
        rec = {"batch_size": size, "params": params, "build_s": build_s, "init_s": init_s,
               "peak_gpu_init_gib": init_peak, **({"init_shared": True} if size != sizes[0] else {})}
        parts: list[dict[str, float]] = []
        losses: list[float] = []

        def one_step() -> bool:
            sync()
            t0 = time.perf_counter()
            with torch.autocast(device_type=device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(**batch).loss
            sync()
            t1 = time.perf_counter()
            scaler.scale(loss).backward()
            sync()
            t2 = time.perf_counter()
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scale = scaler.get_scale()
            scaler.step(opt)  # the scaler skips it when the gradients hold inf/NaN
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sync()
            parts.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": time.perf_counter() - t2})
            losses.append(float(loss))
            return scaler.is_enabled() and scaler.get_scale() < scale

        try:
            batch = make_batch(job, config, size, device)
            reset_gpu_peak()
            times, skipped, first, last = run_steps(one_step, job)
        except Exception as exc:
            if not failure_fields(exc)["oom"]:
                raise
            yield {**rec, **failure_fields(exc), "oom_phase": "step", **gpu_peaks(), "peak_host_gib": host_peak_gib()}
            return
        kept = [p for p, skip in zip(parts[first:last], skipped[first:last]) if not skip]
        rec.update(summarise(times[first:last], skipped[first:last], size), **gpu_peaks(),
                   peak_host_gib=host_peak_gib(), warmup_used=first, skipped_steps=sum(skipped),
                   **({"split": median_parts(kept)} if kept else {}), **loss_fields(losses))
        yield rec


if __name__ == "__main__":
    sys.exit(main())
