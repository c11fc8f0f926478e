"""Do --optimizer-states bf16 and its variants train like the exact mode? A CPU check on the shipped tiny configs.

For each of t5-tiny (the sample task) and gpt2-tiny (the sample task as causal text, "5013 = five thousand
thirteen"), from scratch, bf16 training, micro-batch 16, constant lr, clip 1.0, seed 0, 300 steps, runs that
differ only in the optimizer's states, all in the pipelined update:
  exact         fp32 master and moments (PyTorch's fused AdamW), 14 B/param
  bf16-nearest  bf16 master and moments, rounded to the nearest (fitone.zero2.low_precision), 8 B/param
  bf16          the same, rounded stochastically, 8 B/param
  bf16-kahan    rounded to the nearest, with a bf16 compensation buffer (Kahan summation), 10 B/param
Writes result.json (losses, held-out scores, bytes per parameter) and curves.png into --out.

    python scripts/quality_states_cpu.py --out bench/results/2026-12-02-cpu-kahan
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _harness  # noqa: F401 - the checkout's fitone first on the path

STEPS, BATCH, LR = 300, 16, 3e-3
MODES = {"exact": "fp32", "bf16-nearest": "bf16-nearest", "bf16 (stochastic)": "bf16", "bf16-kahan": "bf16-kahan"}
# the plan's per-parameter host buffers of the pipelined update on a GPU (its lean layout's master, gradients,
# moments, compensation: not the fixed-size ones), read from fitone.plan, not typed in
PER_PARAM = ("master weights", "gradients", "Adam m and v", "compensation")


def causal_sample(folder: Path) -> tuple[str, str]:
    """The sample task as causal-LM text files (train, eval), one {"text": "<digits> = <words>"} per row."""
    from fitone.data import SAMPLE_EVAL, SAMPLE_TRAIN

    paths = []
    for split, source in (("train", SAMPLE_TRAIN), ("eval", SAMPLE_EVAL)):
        path = folder / f"numbers-{split}-text.jsonl"
        rows = [json.loads(line) for line in Path(source).read_text().splitlines()]
        path.write_text("".join(json.dumps({"text": f"{r['source']} = {r['target']}"}) + "\n" for r in rows))
        paths.append(str(path))
    return paths[0], paths[1]


def one_run(model: str, states: str, data: dict) -> dict:
    import fitone
    from fitone.config import TrainConfig

    cfg = TrainConfig(model=model, from_scratch=True, batch_size=BATCH, lr=LR, lr_schedule="constant",
                      warmup_steps=0, max_steps=STEPS, precision="bf16", device="cpu", eval_examples=64,
                      progress=False, seed=0, pipelined_update=True, optimizer_states=states, **data)
    planned = fitone.plan(cfg.replace(device="auto"), gpu_mem="24GiB", host_mem="64GiB")
    per_param = sum(c.bytes for c in planned.host if c.name.endswith(PER_PARAM)) / planned.n_params
    start = time.perf_counter()
    r = fitone.train(cfg)
    return {"losses": r.losses, "quality": r.quality, "skipped_steps": r.skipped_steps,
            "host_bytes_per_param": per_param, "seconds": round(time.perf_counter() - start, 1)}


def plot(results: dict, path: Path) -> None:
    from fitone import render

    fig, axes = render.figure(width=11, height=4.2, cols=len(results))
    for ax, (model, runs) in zip(axes, results.items()):
        for mode, run in runs.items():
            losses = run["losses"]
            window = 10  # a moving average: single-batch losses are noisy at micro-batch 16
            smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                      for i in range(len(losses))]
            ax.plot(range(1, len(losses) + 1), smooth, label=f"{mode}: final {losses[-1]:.3f}")
        ax.set_title(f"{model}, bf16 training (10-step moving average)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend()
    render.save(fig, path, integer_x=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for result.json and curves.png")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_text, eval_text = causal_sample(out)
    data = {"t5-tiny": dict(data="sample", src_len=8, tgt_len=48),
            "gpt2-tiny": dict(data=train_text, eval_data=eval_text, seq_len=32)}
    results: dict = {}
    for model, model_data in data.items():
        results[model] = {}
        for mode, states in MODES.items():
            results[model][mode] = one_run(model, states, model_data)
            print(model, mode, results[model][mode]["losses"][-1], results[model][mode]["quality"], flush=True)
    for name in (train_text, eval_text):
        Path(name).unlink()
    settings = dict(steps=STEPS, micro_batch=BATCH, lr=LR, precision="bf16", seed=0, update="pipelined")
    (out / "result.json").write_text(json.dumps({"settings": settings, "runs": results}, indent=1) + "\n")
    plot(results, out / "curves.png")


if __name__ == "__main__":
    main()
