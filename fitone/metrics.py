"""metrics.jsonl: one JSON object per logged step, appended as training goes (readable mid-run).

With --report-to, each record also goes to TensorBoard (DIR/tensorboard/) and/or W&B (DIR/wandb/);
metrics.jsonl stays the source `fitone report` reads.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from fitone.errors import ConfigError, DataError


class MetricsLog:
    """Appends step records; on resume, drops records past the checkpoint so the curve has no repeats."""

    def __init__(self, path: Path | None, *, resume_step: int | None = None, sinks: list[Sink] | None = None):
        self.path = path
        self.sinks = sinks or []
        if path is None:
            return
        if resume_step is not None and path.exists():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")  # rewritten whole, then renamed: a kill keeps the old file
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        for sink in self.sinks:
            sink.write(int(record.get("step", 0)), _scalars(record))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers under TensorBoard-style names: train/loss ..., or eval/loss ... for a held-out score."""
    held_out = "eval_loss" in record
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[f"eval/{key.removeprefix('eval_')}" if held_out else f"train/{key}"] = float(value)
    return out


def open_sinks(names: list[str], out: Path, config: dict[str, Any], *, resume_step: int = 0,
               verbose: bool = False) -> list[Sink]:
    """The --report-to loggers, each given the run's config once; W&B's own lines only with `verbose`."""
    sinks: list[Sink] = []
    for name in names:
        sinks.append(TensorBoardSink(out / "tensorboard", config, resume_step) if name == "tensorboard"
                     else WandbSink(out, config, resume_step, verbose=verbose))
    return sinks


class TensorBoardSink:
    def __init__(self, log_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # on resume, TensorBoard hides what an older file logged past the checkpoint, as metrics.jsonl drops it
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```",
                             global_step=resume_step)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # readable mid-run, as metrics.jsonl is

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """W&B in DIR/wandb/. Offline (sync later with `wandb sync DIR/wandb/offline-run-*`) when WANDB_MODE
    does not say otherwise and there is no API key or the W&B server does not answer: never a login prompt."""

    def __init__(self, out: Path, config: dict[str, Any], resume_step: int, *, verbose: bool = False):
        import wandb

        mode, why = wandb_mode()
        if why:
            print(f"fitone: W&B runs offline ({why}): sync later with `wandb sync {out / 'wandb'}/offline-run-*`",
                  flush=True)
        # mode None: wandb decides (its settings files, e.g. after `wandb offline`)
        try:
            # silent unless --verbose: its ~25 lines (versions, where the run is, the history and summary at
            # the end) would break up fitone's quiet output; fitone says where the run is and how to sync it
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fitone"), dir=str(out), config=config,
                                  mode=mode, name=out.name, resume="allow" if resume_step else None,
                                  settings=None if verbose else wandb.Settings(silent=True))
        except wandb.errors.Error as exc:  # e.g. WANDB_MODE=online without a key: no API key configured
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"--report-to wandb: {first} (or unset WANDB_MODE to log offline and "
                              "`wandb sync` later)") from exc

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode() -> tuple[str | None, str | None]:
    """W&B's mode for this run and, when fitone chose offline, why. WANDB_MODE wins; else offline without an
    API key (wandb would prompt for one) or when the server is not reached within a couple of seconds."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], None
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(host)):
        return "offline", "no W&B API key: WANDB_API_KEY or `wandb login`"
    if not _reachable(host, url.port or (80 if url.scheme == "http" else 443)):
        return "offline", f"{host} not reachable"
    return None, None


def _netrc_has(host: str) -> bool:
    """Whether `wandb login` left a key for host in the netrc file wandb reads."""
    import netrc

    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _reachable(host: str, port: int = 443, timeout: float = 2.0) -> bool:
    """A TCP connect to host within timeout. In a thread: name resolution has no timeout of its own and can
    hang far longer where DNS is blackholed."""
    import socket
    import threading

    ok: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"no metrics file at {path}: give a run directory written by `fitone train --out`")
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if lineno == len(lines) and not text.endswith("\n"):
                    break  # the last append was cut short by a kill: that step is simply not logged
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
    return rows
