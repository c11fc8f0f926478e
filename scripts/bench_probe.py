#!/usr/bin/env python3
"""Issue 4's bar: is `fitone probe-batch` fast, and is its answer right?

Three child processes, so that each starts with a clean GPU:
  1. `fitone probe-batch ... --no-cache --json`: the found size and the probe's wall time (engine init included);
  2. `fitone train ... --batch-size FOUND --max-steps 20`: the found size must train without running out of memory;
  3. `fitone train ... --batch-size NEXT --max-steps 2`, NEXT = the smallest size that ran out of memory in the
     probe (or largest fit + granularity): it must run out of memory.
One JSON record ("tool": "fitone-probe") is appended to the list in --out.

    python scripts/bench_probe.py --model t5-3b --src-len 128 --tgt-len 128 --out bench/results/probe-h200.json
    python scripts/bench_probe.py --model t5-3b --src-len 512 --tgt-len 128 --out bench/results/probe-h200.json
    python scripts/bench_probe.py --model gpt2-xl --seq-len 1024 --out bench/results/probe-h200.json
    python scripts/bench_probe.py --model t5-tiny --device cpu --precision fp32 --cap none --src-len 8 --tgt-len 8 \\
        --max-batch 4 --verify-steps 1 --train-steps 2 --out /tmp/probe-smoke.json      # CPU smoke run

When one call would outlast a time limit, split it: `--phases probe --probe-json P`, then
`--phases train,next --probe-json P` (the second record is the complete one).

Before the probe a child builds DeepSpeed's cpu_adam extension (a one-time ~50 s JIT compile on a fresh
machine, not part of probing); its time is recorded as `jit_warmup_s`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, checkout_env, command, model_task


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="t5-3b", help="shipped config name, built with random weights")
    p.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--src-len", type=int, default=128)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=1024, help="causal LMs (gpt2-*, llama-*)")
    p.add_argument("--cap", default="23GiB", help="--max-gpu-memory for every child ('none': no cap)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    p.add_argument("--no-pipelined-update", dest="pipelined_update", action="store_false",
                   help="every child on DeepSpeed's step (the results before the pipelined update became the "
                        "default, bench/results/2026-11-29-probe*/, ran it)")
    p.add_argument("--max-batch", type=int, default=None, help="probe-batch --max-batch (default: its own)")
    p.add_argument("--verify-steps", type=int, default=None, help="probe-batch --verify-steps (default: its own)")
    p.add_argument("--train-steps", type=int, default=20, help="steps the found size must train")
    p.add_argument("--oom-steps", type=int, default=2, help="steps the next size is tried for")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the cpu_adam build first")
    p.add_argument("--phases", default="probe,train,next",
                   help="what to run; split a run over two commands with 'probe' then 'train,next' and the "
                        "same --probe-json")
    p.add_argument("--probe-json", default=None, help="where the probe writes its JSON (read when not probing)")
    p.add_argument("--log-dir", default=None, help="keep each child's full output here")
    p.add_argument("--out", required=True, help="JSON file holding a list of records; this run's is appended")
    return p


def model_args(args: argparse.Namespace) -> list[str]:
    """The options every child shares: what decides memory."""
    out = ["--model", args.model, "--from-scratch", "--data", "synthetic", "--precision", args.precision,
           "--device", args.device]
    if is_causal(args.model):
        out += ["--seq-len", str(args.seq_len)]
    else:
        out += ["--src-len", str(args.src_len), "--tgt-len", str(args.tgt_len)]
    if args.cap.lower() != "none":
        out += ["--max-gpu-memory", args.cap]
    if not args.activation_checkpointing:
        out.append("--no-activation-checkpointing")
    if not args.pipelined_update:
        out.append("--no-pipelined-update")
    return out


def is_causal(model: str) -> bool:
    return model_task(model) == "causal"  # from its config file, as the tool comparison decides it


def fitone_cmd(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "fitone", *arguments]


def shown(cmd: list[str]) -> str:
    """The command as a user types it: `fitone ...`."""
    return shlex.join(["fitone", *cmd[3:]])


def train_cmd(common: list[str], size: int, steps: int) -> list[str]:
    # fp16 may skip early steps while the loss scale settles: only memory is judged here, so no NaN-streak stop
    return fitone_cmd("train", *common, "--batch-size", str(size), "--max-steps", str(steps), "--no-progress",
                      "--eval-examples", "0", "--max-bad-steps", str(steps + 1))


def run_child(cmd: list[str], timeout: float, log_dir: Path | None, name: str) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, combined output, seconds)."""
    env = checkout_env(PYTHONUNBUFFERED="1")
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code = None
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    seconds = time.perf_counter() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{name}.log").write_text(f"$ {shlex.join(cmd)}\n{output}\nexit {code} after {seconds:.1f} s\n")
    print(f"  exit {code} after {seconds:.1f} s", flush=True)
    return code, output, seconds


def ran_out_of_memory(output: str) -> bool:
    return bool(re.search(r"out of memory|OutOfMemoryError", output))


def tail(text: str, n: int = 12) -> str:
    return "\n".join(line for line in text.strip().splitlines()[-n:])


def train_numbers(output: str) -> dict[str, float]:
    """samples/s and peak GPU GiB from the `TrainResult(...)` line `fitone train` prints."""
    found = {}
    m = re.search(r"([\d.]+) samples/s, peak GPU ([\d.]+) GiB", output)
    if m:
        found = {"train_samples_per_s": float(m.group(1)), "train_peak_gpu_gib": float(m.group(2))}
    return found


def _gib(n_bytes: int) -> float:
    value = n_bytes / 1024**3
    return int(value) if value == int(value) else round(value, 3)


def append_record(path: Path, record: dict[str, Any]) -> None:
    records = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else []
    if not isinstance(records, list):
        raise SystemExit(f"{path} does not hold a JSON list")
    records.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    phases = set(args.phases.split(","))
    if not phases <= {"probe", "train", "next"} or ("next" in phases and "train" not in phases):
        raise SystemExit("--phases: a comma list of probe, train, next (next needs train)")
    log_dir = Path(args.log_dir) if args.log_dir else None
    common = model_args(args)
    record: dict[str, Any] = {
        "tool": "fitone-probe", "model": args.model, "precision": args.precision,
        **({"seq_len": args.seq_len} if is_causal(args.model) else {"src_len": args.src_len, "tgt_len": args.tgt_len}),
        "cap": args.cap, "cap_gib": None, "activation_checkpointing": args.activation_checkpointing,
        "pipelined_update_default": args.pipelined_update,
        "found_batch_size": None, "wall_s": None, "verified_fits": None, "next_size_ooms": None, "trials": [],
        "command": command("scripts/bench_probe.py", sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
    }
    errors: dict[str, str] = {}
    try:
        if args.warmup and args.device != "cpu" and "probe" in phases:
            code, output, record["jit_warmup_s"] = run_child(
                [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
                args.timeout, log_dir, "warmup")
            if code != 0:
                errors["warmup"] = tail(output)

        # 1. the probe (or, with --phases train,next, the one an earlier call wrote to --probe-json)
        with tempfile.TemporaryDirectory() as tmp:
            probe_json = Path(args.probe_json or Path(tmp) / "probe.json")
            if "probe" in phases:
                cmd = fitone_cmd("probe-batch", *common, "--no-cache", "--json", str(probe_json))
                for flag, value in (("--max-batch", args.max_batch), ("--verify-steps", args.verify_steps)):
                    if value is not None:
                        cmd += [flag, str(value)]
                record["probe_command"] = shown(cmd)
                code, output, record["probe_process_s"] = run_child(cmd, args.timeout, log_dir, "probe")
                if code != 0 or not probe_json.exists():
                    errors["probe"] = tail(output)
                    return 1
            elif not probe_json.is_file():
                raise SystemExit("--phases without probe needs --probe-json: the JSON an earlier probe wrote")
            probe = json.loads(probe_json.read_text())
        found = probe["chosen"]
        next_size = probe["smallest_oom"] or probe["largest_fit"] + probe["granularity"]
        meta = probe["meta"]
        record.update(found_batch_size=found, largest_fit=probe["largest_fit"], smallest_oom=probe["smallest_oom"],
                      granularity=probe["granularity"], next_size=next_size, best_throughput=probe["best_throughput"],
                      wall_s=round(probe["wall_s"], 2), engine_init_s=meta.get("engine_init_s"),
                      search_s=meta.get("search_s"), trials=probe["trials"], gpu=meta.get("gpu"),
                      cap_gib=_gib(probe["cap_bytes"]) if meta.get("max_gpu_memory") else None,
                      params=meta.get("params"), versions=meta.get("versions"))
        print(f"probe: found {found} (largest fit {probe['largest_fit']}, smallest OOM {probe['smallest_oom']}) "
              f"in {probe['wall_s']:.1f} s", flush=True)

        # 2. the found size trains
        if "train" not in phases:
            return 0
        cmd = train_cmd(common, found, args.train_steps)
        record["train_command"] = shown(cmd)
        code, output, record["train_s"] = run_child(cmd, args.timeout, log_dir, "train")
        record["verified_fits"] = code == 0
        record.update(train_numbers(output))
        if code != 0:
            errors["train"] = tail(output)

        # 3. the next size up runs out of memory
        if "next" not in phases:
            return 0 if record["verified_fits"] else 1
        cmd = train_cmd(common, next_size, args.oom_steps)
        record["oom_command"] = shown(cmd)
        code, output, record["oom_try_s"] = run_child(cmd, args.timeout, log_dir, "next-size")
        if code == 0:
            record["next_size_ooms"] = False
        elif code is not None and ran_out_of_memory(output):
            record["next_size_ooms"] = True
        else:
            errors["next_size"] = tail(output)  # failed for another reason: neither proven nor disproven
        return 0 if record["verified_fits"] and record["next_size_ooms"] else 1
    finally:
        if errors:
            record["errors"] = errors
        append_record(Path(args.out), record)
        summary = {k: record.get(k) for k in ("model", "cap_gib", "found_batch_size", "next_size", "wall_s",
                                               "verified_fits", "next_size_ooms")}
        print(f"record appended to {args.out}: {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
