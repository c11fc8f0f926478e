"""The LM head + loss alone, forward and backward, at one micro-batch: the model's own loss (transformers'
upcast logits and cross-entropy) against fitone's fused ones (Liger-Kernel's where installed, the chunked one).

    python scripts/bench_loss.py --tokens 8176 --hidden 4096 --vocab 32000,128256 --out results/

Times `--iters` forward + backward passes after `--warmup` (CUDA events, median), and the peak memory above the
inputs. It says what the loss itself costs, apart from the steps' noise: a training step adds the same backbone
either way. Writes one JSON record per (vocab, loss) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from _harness import GIB, command, write_json


def _own(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    # what a transformers causal LM does after its backbone: the head in the model's dtype, then its loss (which
    # upcasts the logits to fp32); the labels here are already shifted, as the fused path's are
    logits = torch.nn.functional.linear(hidden, weight)
    return ForCausalLMLoss(logits, labels, vocab_size=weight.shape[0], shift_labels=labels)


def _fused(backend: str):
    from fitone.loss import linear_cross_entropy

    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, backend=backend)


def measure(loss_fn, tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, warmup: int,
            iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device="cuda", dtype=dtype, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device="cuda", generator=gen)
    times = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + iters):
        hidden.grad = weight.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = loss_fn(hidden, weight, labels)
        loss.backward()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return {"ms": round(statistics.median(times), 3), "ms_min": round(min(times), 3),
            "ms_max": round(max(times), 3), "loss": float(loss),
            "peak_over_inputs_gib": round((torch.cuda.max_memory_allocated() - base) / GIB, 3)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16 * 511, help="tokens a micro-batch (llama-7b recipe: 16 x 511)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", default="32000,128256", help="comma list of vocabulary sizes")
    p.add_argument("--losses", default="own,liger,chunked")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="a folder for bench-loss.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_loss: needs a CUDA GPU", file=sys.stderr)
        return 2
    from fitone.loss import liger_available

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    records = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for name in args.losses.split(","):
            if name == "liger" and not liger_available():
                print(f"vocab {vocab}: liger skipped (liger-kernel not importable)")
                continue
            fn = _own if name == "own" else _fused(name)
            rec = {"tool": f"loss-{name}", "vocab": vocab, "tokens": args.tokens, "hidden": args.hidden,
                   "dtype": args.dtype, "gpu": torch.cuda.get_device_name(),
                   **measure(fn, args.tokens, args.hidden, vocab, dtype, args.warmup, args.iters),
                   "command": command("scripts/bench_loss.py", argv)}
            records.append(rec)
            print(f"vocab {vocab:>7} {name:>8}: {rec['ms']:8.2f} ms (min {rec['ms_min']}, max {rec['ms_max']}), "
                  f"peak {rec['peak_over_inputs_gib']:.2f} GiB over the inputs, loss {rec['loss']:.4f}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        write_json(Path(args.out) / "bench-loss.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
