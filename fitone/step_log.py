"""Each optimizer step's record: metrics.jsonl (and its sinks) every --log-every steps, and the progress bar."""

from __future__ import annotations

from typing import Any

from fitone import memory
from fitone.metrics import MetricsLog
from fitone.units import gib


class StepLog:
    """The run's step records and, on the main rank with --progress, its tqdm bar."""

    def __init__(self, metrics: MetricsLog, *, log_every: int, total_steps: int, first_step: int, bar: bool):
        self.metrics, self.log_every, self.total_steps = metrics, log_every, total_steps
        self.bar = None
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True)

    def write(self, *, step: int, epoch: int, loss: float, dt: float, samples: int, tokens: int, engine: Any,
              peak_rss: int) -> None:
        """`samples` and `tokens`: this step's, over every rank."""
        record = {
            "step": step, "loss": loss, "lr": engine.lr, "step_s": dt,
            "samples_per_s": samples / dt, "tokens_per_s": tokens / dt,
            "gpu_peak_gib": gib(memory.gpu_peak_bytes()),
            "host_rss_gib": gib(memory.host_rss_bytes()), "epoch": epoch,
            "skipped_steps": engine.skipped_steps,
        }
        if engine.loss_scale is not None:
            record["loss_scale"] = engine.loss_scale
        grad_norm = engine.grad_norm  # read once: it may be a GPU scalar
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        # the overlapped update's thread time, its wait and (speculation) counters: why a step was slow
        record.update({f"update_{k}": v for k, v in engine.update_timing.items()})
        # the first and last steps always: `fitone report` starts and ends where TrainResult does
        if step % self.log_every == 0 or step in (1, self.total_steps):
            self.metrics.write(record)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", sps=f"{record['samples_per_s']:.1f}",
                                 gpu=f"{record['gpu_peak_gib']:.1f}G", host=f"{gib(peak_rss):.1f}G", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
