"""Issue 19's measurement of one `fitone train` run: GPU init peak, host RSS (sampled every 0.2 s, with the
phase it was in), tokens/s, the host bytes per parameter fitone's optimizer holds. Prints one JSON line
(`BENCH7B {...}`) and writes it to $OUT/bench7b-<tag>.json; every ~10 s it writes the record so far to
$OUT/bench7b-<tag>.partial.json (removed at the end), which a run cut by a hard time limit leaves behind.

    python scripts/bench_train.py TAG -- train --recipe llama-7b/24gb model=llama-7b from_scratch=true \
        data=synthetic max_steps=21 save_every=20 out=/tmp/run --overwrite

Everything after `--` is fitone's command line, run in this process (fitone.cli.dispatch). `--loss chunked`
before `--` keeps the fused loss off Liger-Kernel (to time the two fused paths against each other), `--loss
any-vocab` takes the fused loss whatever the vocabulary (to time it against the model's own on a small one), `--loss
alternate` trains odd optimizer steps with the model's own loss and even ones with the fused loss, in one engine (an
A/B that no machine drift or run order can tilt: the record's `alternate` compares the two kinds of step);
`--no-export` skips writing final/ (speed comparisons).
The record carries model, tool, cap_gib, micro_batch, seq_len, grad_accum, tokens_per_s, peak_gpu_gib,
peak_host_gib and params, so that a run can be checked against a bar.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from _harness import GIB  # and the checkout first on the path


def choose_loss(how: str) -> list[str]:
    """`--loss`: which fused loss the run takes where fitone's own rule would pick another; returns the list
    `--loss alternate` writes each engine forward's choice to ('own' or 'fused')."""
    from fitone import loss as fitone_loss

    assert how in ("chunked", "any-vocab", "alternate"), how
    if how == "chunked":
        fitone_loss.liger_available = lambda: False
        return []
    fitone_loss.FUSED_MIN_VOCAB_GPU = 0  # the fused loss whatever the vocabulary (a GPU keeps the model's own below)
    return alternate_losses(fitone_loss) if how == "alternate" else []


def alternate_losses(fitone_loss: Any) -> list[str]:
    """The model's own loss on odd optimizer steps, the fused one on even steps: the fused install keeps the model's
    own forward beside it, and each engine forward picks one by its optimizer step."""
    from fitone.engine import Engine

    fused_now, calls, used = [False], [0], []
    install, engine_forward = fitone_loss.install, Engine.forward

    def alternating_install(model: torch.nn.Module, backend: str) -> None:
        own = model.forward
        install(model, backend)
        fused = model.forward
        model.forward = lambda *a, **k: (fused if fused_now[0] else own)(*a, **k)

    def forward(self: Engine, batch: dict) -> torch.Tensor:
        fused_now[0] = (calls[0] // self.ds.gradient_accumulation_steps()) % 2 == 1
        calls[0] += 1
        used.append("fused" if fused_now[0] else "own")
        return engine_forward(self, batch)

    fitone_loss.install, Engine.forward = alternating_install, forward
    return used


def main(argv: list[str]) -> int:
    tag, fitone_args = argv[0], argv[argv.index("--") + 1:]
    skip_export = "--no-export" in argv[:argv.index("--")]
    used = choose_loss(argv[argv.index("--loss") + 1]) if "--loss" in argv[:argv.index("--")] else []
    import importlib

    from fitone.zero2.timing import timed_engines

    fitone_train = importlib.import_module("fitone.train")  # the module, not fitone.train the function
    from fitone.cli import dispatch

    record: dict = {"tag": tag, "command": "fitone " + " ".join(fitone_args),
                    "bench_args": " ".join(argv[1:argv.index("--")])}
    phase = ["start"]
    samples: list[tuple[float, float, str]] = []
    proc = psutil.Process()
    stop = threading.Event()

    partial = Path(os.environ.get("OUT", ".")) / f"bench7b-{tag}.partial.json"

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), proc.memory_info().rss / GIB, phase[0]))
            if len(samples) % 50 == 0:  # every ~10 s: what a run cut by a hard limit leaves behind
                write_partial(partial, record, samples, fitone_args)
            stop.wait(0.2)

    def init_starts() -> None:
        phase[0] = "engine init"
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def init_done(self) -> None:  # the Engine's own hook (fitone.zero2.timing), without its phase timer
        record["init_s"] = round(self.init_s, 1)
        if torch.cuda.is_available():
            record["peak_gpu_init_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            record["gpu_after_init_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
            record["weights_16bit_gib"] = round(sum(f.numel() * f.element_size()
                                                    for f in self.optimizer.bit16_groups_flat) / GIB, 3)
            torch.cuda.reset_peak_memory_stats()
        record["groups"] = len(self.optimizer.bit16_groups)
        record["params"] = sum(p.numel() for p in self.module.parameters())
        phase[0] = "steps"

    plain_save, plain_export = fitone_train.Trainer._save, fitone_train.Trainer._export

    def save(self, *a, **k):
        phase[0] = "save"
        t0 = time.perf_counter()
        try:
            return plain_save(self, *a, **k)
        finally:
            record.setdefault("save_s", []).append(round(time.perf_counter() - t0, 1))
            phase[0] = "steps"

    def export(self, *a, **k):
        phase[0] = "export"
        record.update(model=self.cfg.model, tool="fitone", cap_gib=self.cfg.max_gpu_memory,
                      micro_batch=self.micro_batch,
                      seq_len=self.cfg.seq_len, grad_accum=self.accum, precision=self.cfg.precision)
        if self.engine.host is not None:
            record["optimizer_host_gib"] = {k: round(v / GIB, 3) for k, v in self.engine.host.host_bytes().items()}
        if skip_export:  # a speed comparison: the export is measured in the runs that keep it
            return None
        return plain_export(self, *a, **k)

    fitone_train.Trainer._save, fitone_train.Trainer._export = save, export
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        with timed_engines(phases=False, on_start=init_starts, on_built=init_done):
            record["exit"] = dispatch(fitone_args)
    except BaseException as exc:  # noqa: BLE001 - the record says what happened
        record["exit"] = repr(exc)[:500]
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    if used:
        record["loss_by_forward"] = used
    stop.set()
    sampler.join()
    if torch.cuda.is_available():
        record["peak_gpu_steps_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    record.update(host_fields(samples, record.get("params")))
    record.update(metrics_fields(fitone_args, record))
    record["peak_gpu_gib"] = max(record.get("peak_gpu_init_gib", 0), record.get("peak_gpu_steps_gib", 0))
    record["peak_host_gib"] = max(record["peak_host_gib_by_phase"].values(), default=None)
    print("BENCH7B " + json.dumps(record), flush=True)
    dest = Path(os.environ.get("OUT", ".")) / f"bench7b-{tag}.json"
    dest.write_text(json.dumps(record, indent=1))
    partial.unlink(missing_ok=True)
    return 0


def write_partial(dest: Path, record: dict, samples: list[tuple[float, float, str]], fitone_args: list[str]) -> None:
    """The record so far (host peaks by phase, the steps' metrics), for a run killed before its end."""
    try:
        snapshot = {**record, "partial": True, **host_fields(list(samples), record.get("params")),
                    **metrics_fields(fitone_args, record)}
        dest.write_text(json.dumps(snapshot, indent=1))
    except (OSError, ValueError):  # a metrics line being written, a full disk: the next snapshot tries again
        pass


def host_fields(samples: list[tuple[float, float, str]], params: int | None) -> dict:
    """Peak host RSS by phase, before the export, and per parameter, from the 0.2 s samples."""
    by_phase: dict[str, float] = {}
    for _, rss, ph in samples:
        by_phase[ph] = max(by_phase.get(ph, 0.0), rss)
    out: dict = {"peak_host_gib_by_phase": {k: round(v, 2) for k, v in by_phase.items()},
                 "peak_host_gib_before_export": round(max((r for _, r, ph in samples if ph != "export"), default=0),
                                                      2)}
    if params:
        out["host_bytes_per_param_before_export"] = round(out["peak_host_gib_before_export"] * GIB / params, 2)
    return out


def metrics_fields(fitone_args: list[str], record: dict) -> dict:
    """Steps, losses and the median step from the run's metrics.jsonl (after its first 3 steps)."""
    out_dir = next((a.split("=", 1)[1] for a in fitone_args if a.startswith("out=")), None)
    if "--out" in fitone_args:
        out_dir = fitone_args[fitone_args.index("--out") + 1]
    if not out_dir or not (Path(out_dir) / "metrics.jsonl").exists():
        return {}
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    out: dict = {"steps": len(rows), "loss_first_last": [rows[0].get("loss"), rows[-1].get("loss")] if rows else None}
    timed = sorted(r["step_s"] for r in rows[3:] if r.get("step_s"))
    if timed:
        out["median_step_s"] = timed[len(timed) // 2]
        out["samples_per_s_median"] = [r.get("samples_per_s") for r in rows[3:]][len(timed) // 2]
        if record.get("seq_len"):  # synthetic rows are full --seq-len rows
            tokens = record["seq_len"] * record["micro_batch"] * record["grad_accum"]
            out["tokens_per_s"] = round(len(timed) * tokens / sum(timed), 1)
            if "--loss alternate" in record.get("bench_args", ""):
                out["alternate"] = alternate_fields(rows[3:], tokens)
    return out


def alternate_fields(rows: list[dict], tokens: int) -> dict:
    """`--loss alternate`'s two kinds of step (odd: the model's own loss, even: the fused one): tokens/s over each
    kind's steps, and the speed ratio fused / own of each pair of neighbouring steps (the spread between them)."""
    kinds = {"own": [r["step_s"] for r in rows if r["step"] % 2],
             "fused": [r["step_s"] for r in rows if not r["step"] % 2]}
    out: dict = {k: {"steps": len(v), "tokens_per_s": round(len(v) * tokens / sum(v), 1) if v else None,
                     "step_s": v} for k, v in kinds.items()}
    by_step = {r["step"]: r["step_s"] for r in rows}
    out["fused_speed_over_own_per_pair"] = [round(by_step[s] / by_step[s + 1], 4) for s in sorted(by_step)
                                            if s % 2 and s + 1 in by_step]  # own step's time / the next fused one's
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
