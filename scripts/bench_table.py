#!/usr/bin/env python3
"""Render benchmark results (scripts/bench_tools.py's JSON) as the markdown tables of bench/README.md.

    python scripts/bench_table.py bench/results/2026-11-29-nvidia-h200.json
    python scripts/bench_table.py $OUT1/*.json $OUT2/*.json --merge bench/results/2026-11-29-nvidia-h200.json

Several files (one per command) are read in order; `--merge FILE` also writes them as one list.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

SPLIT_KEYS = ("forward_s", "backward_s", "optimizer_s")
DETAIL_KEYS = ("backward_compute_s", "grad_transfer_s", "grad_norm_s", "unscale_clip_s", "cpu_adam_s",
               "param_upload_s", "allgather_s", "optimizer_other_s")
# an overlapped update's host counters (fitone's pipelined/delayed step), recorded in `split`
UPDATE_KEYS = ("update_cpu_adam_s", "update_thread_s", "update_wait_s")


def load(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, list):
            raise SystemExit(f"{path}: expected a JSON list of records (scripts/bench_tools.py output)")
        records += data
    return records


def _num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _setup(rec: dict[str, Any]) -> tuple:
    return (rec.get("model"), rec.get("params"), rec.get("precision"), rec.get("src_len"), rec.get("tgt_len"),
            rec.get("seq_len"), rec.get("gpu"), rec.get("activation_checkpointing"))


def tool_cell(rec: dict[str, Any]) -> str:
    groups = rec.get("ds_param_groups") or 1
    return f"{rec.get('tool')}{f' ({groups} groups)' if groups > 1 else ''}"


def batch_cell(rec: dict[str, Any]) -> str:
    """The micro-batch, and with accumulation the micro-batches per step and the sequences they make."""
    accum = rec.get("grad_accum") or 1
    size = rec.get("batch_size")
    return f"{size} x {accum} = {size * accum}" if accum > 1 and isinstance(size, int) else str(size)


def result_cell(rec: dict[str, Any]) -> str:
    """What happened, when it is not a plain timing: OOM, error, the auto-find outcome, skipped steps."""
    if rec.get("error"):
        seen = rec.get("peak_host_gib_last_seen")
        return "error: " + str(rec["error"]).splitlines()[0][:120] + (
            f" (host RSS {seen:.1f} GiB {rec.get('last_seen_s', 0):.0f} s in)" if seen is not None else "")
    if rec.get("oom"):
        return "OOM" + (f" ({rec['note']})" if rec.get("note") else "")
    notes = []
    if rec.get("outcome"):
        notes.append(str(rec["outcome"])[:160] + (f" after {rec['elapsed_s']:.0f} s" if rec.get("elapsed_s") else ""))
    if rec.get("timed_skipped"):
        notes.append(f"{rec['timed_skipped']} timed steps skipped (fp16 overflow)")
    if rec.get("init_shared"):
        notes.append("same process as smaller sizes")
    return "; ".join(notes)


def render(records: list[dict[str, Any]]) -> str:
    """Markdown: one table per setup (model, precision, lengths, GPU), then the step split where recorded.
    A causal LM's table also has tokens/s and the GPU peak of the engine's init."""
    if not records:
        return "(no records)"
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(_setup(rec), []).append(rec)
    parts = []
    for (model, params, precision, src, tgt, seq, gpu, ckpt), recs in groups.items():
        size = f", {params / 1e9:.3f}B params" if params else ""
        dates = sorted({r.get("date") for r in recs if r.get("date")})
        lengths = f"seq {seq}" if seq else f"src/tgt {src}/{tgt}"
        parts.append(f"**{model}**{size}, {precision}, {lengths}, "
                     f"activation checkpointing {'on' if ckpt else 'off'}, on {gpu} ({', '.join(dates)})\n")
        causal = bool(seq)
        parts.append("| tool | cap GiB | micro-batch | s/step (min–max) | samples/s "
                     f"{'| tokens/s ' if causal else ''}| peak GPU GiB {'| GPU init GiB ' if causal else ''}"
                     "| peak host GiB | init s | result |")
        parts.append("|---" * (11 if causal else 9) + "|")
        for r in recs:
            spread = r.get("step_s_spread")
            step = _num(r.get("step_s"), ".3f") + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else "")
            tokens = f"| {_num(r.get('tokens_per_s'), ',.0f')} " if causal else ""
            init_peak = f"| {_num(r.get('peak_gpu_init_gib'), '.2f')} " if causal else ""
            parts.append(f"| {tool_cell(r)} | {_num(r.get('cap_gib'), 'g') if r.get('cap_gib') else 'none'} "
                         f"| {batch_cell(r)} | {step} | {_num(r.get('samples_per_s'), '.1f')} {tokens}"
                         f"| {_num(r.get('peak_gpu_gib'), '.2f')} {init_peak}| {_num(r.get('peak_host_gib'), '.1f')} "
                         f"| {_num(r.get('init_s'), '.1f')} | {result_cell(r)} |")
        parts.append("")
        split = [r for r in recs if r.get("split") or r.get("split_detail")]
        if split:
            parts.append(split_table(split))
    return "\n".join(parts).rstrip() + "\n"


def split_table(recs: list[dict[str, Any]]) -> str:
    """Seconds per part of one step: the timed steps' forward/backward/optimizer (and an overlapped update's
    counters), and the detail step's parts."""
    update = [k for k in UPDATE_KEYS if any(k in (r.get("split") or {}) for r in recs)]
    detail = [k for k in DETAIL_KEYS if any(k in (r.get("split_detail") or {}) for r in recs)]
    head = ["tool", "micro-batch", *SPLIT_KEYS, *[f"update: {k[len('update_'):]}" for k in update],
            *[f"detail: {k}" for k in detail]]
    rows = ["| " + " | ".join(h.replace("_s", "") for h in head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        coarse, fine = r.get("split") or {}, r.get("split_detail") or {}
        cells = [tool_cell(r), batch_cell(r)]
        cells += [_num(coarse.get(k), ".3f") for k in (*SPLIT_KEYS, *update)]
        cells += [_num(fine.get(k), ".3f") for k in detail]
        rows.append("| " + " | ".join(cells) + " |")
    note = "; update: the overlapped update's host counters, wait = the main thread blocked on it" if update else ""
    return f"Where a step's time goes (seconds; detail from an extra step with a sync around each part{note}):\n\n" + \
        "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="results JSON files from scripts/bench_tools.py")
    parser.add_argument("--merge", metavar="FILE", help="also write all records as one JSON list to FILE")
    args = parser.parse_args(argv)
    records = load(args.files)
    if args.merge:
        Path(args.merge).parent.mkdir(parents=True, exist_ok=True)
        Path(args.merge).write_text(json.dumps(records, indent=1) + "\n")
    sys.stdout.write(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
