"""Do the overlapped updates train as well as the default? A CPU check on the sample task.

Five runs of t5-tiny on the bundled sample task (fp32, micro-batch 16, clip 1.0, constant lr, 300 steps):
  fitone default        DeepSpeed ZeRO-2 offload, fitone.train
  fitone --pipelined-update the same arithmetic, run beside the next forward (fitone.zero2.overlap)
  fitone --delayed-update   the one-step delayed update after 20 plain steps (fitone.zero2.overlap)
  torch AdamW           a plain PyTorch loop on the same model, data order and clipping
  torch AdamW, delayed  the same loop applying each step's gradients one step late (after 20 plain steps)
The two torch loops say whether a gap between the fitone runs comes from the method (staleness) or from
fitone's implementation of it.

    python scripts/quality_cpu.py --out bench/results/2026-11-29-cpu-delayed-update/result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _harness  # noqa: F401 - the checkout's fitone first on the path

STEPS, AFTER, BATCH = 300, 20, 16


def fitone_run(lr: float, mode: str) -> dict:
    import fitone
    from fitone.config import TrainConfig

    cfg = TrainConfig(model="t5-tiny", from_scratch=True, data="sample", src_len=8, tgt_len=48, batch_size=BATCH,
                      lr=lr, lr_schedule="constant", warmup_steps=0, max_steps=STEPS, precision="fp32",
                      device="cpu", eval_examples=64, progress=False, seed=0,
                      delayed_update=mode == "delayed", delayed_update_after=AFTER,
                      pipelined_update=mode == "pipelined")
    r = fitone.train(cfg)
    return {"losses": r.losses, "quality": r.quality, "skipped_steps": r.skipped_steps}


def torch_run(lr: float, mode: str) -> dict:
    import torch

    from fitone.config import TrainConfig
    from fitone.data import batches, load_dataset
    from fitone.models import load_model

    cfg = TrainConfig(model="t5-tiny", from_scratch=True, data="sample", src_len=8, tgt_len=48, device="cpu")
    lm = load_model("t5-tiny", from_scratch=True, seed=0)
    model = lm.model.train()
    data = load_dataset(cfg.data_settings(), "seq2seq", lm.tokenizer, lm.config.vocab_size)
    stream = batches(data, BATCH, seed=0, pad_id=lm.tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    params = list(model.parameters())
    losses, pending = [], None

    def apply(grads):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        model.zero_grad(set_to_none=True)

    for step in range(STEPS):
        _, _, batch = next(stream)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        grads = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        if mode == "delayed" and step >= AFTER:
            if pending is not None:
                apply(pending)
            pending = grads
        else:
            apply(grads)
        losses.append(loss.item())
    return {"losses": losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = {}
    for name, fn, mode in (("fitone default", fitone_run, "default"),
                           ("fitone --pipelined-update", fitone_run, "pipelined"),
                           ("fitone --delayed-update", fitone_run, "delayed"),
                           ("torch AdamW", torch_run, "default"), ("torch AdamW, delayed", torch_run, "delayed")):
        t0 = time.perf_counter()
        rows[name] = {**fn(args.lr, mode), "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"lr {args.lr:g}, {STEPS} steps, micro-batch {BATCH}; mean loss over steps 1-50, 51-100, ...; eval")
    for name, r in rows.items():
        L = r["losses"]
        means = " ".join(f"{sum(L[i:i + 50]) / 50:.3f}" for i in range(0, STEPS, 50))
        q = r.get("quality") or {}
        ev = f"eval_loss {q['eval_loss']:.3f}, token_accuracy {q['token_accuracy']:.3f}" if q else ""
        print(f"  {name:26s} {means}   {ev}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"lr": args.lr, "steps": STEPS, "after": AFTER, "micro_batch": BATCH,
                                    "command": "python " + " ".join(sys.argv), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
