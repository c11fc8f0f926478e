"""Load an exported model dir the way its users will (`from_pretrained`, no DeepSpeed, no fitone) and report
what came back: the shard files, the parameter count and dtype, and one forward's loss on the CPU. Prints
one JSON line (`EXPORT {...}`) and writes it to OUT/export-check.json when --out is given.

    python scripts/check_export.py /tmp/run-7b/final --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from _harness import GIB  # and the checkout first on the path


def check(model_dir: Path) -> dict:
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json", ".bin"))
    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    t0 = time.perf_counter()
    model = auto.from_pretrained(model_dir, dtype="auto")
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, config.vocab_size, (1, 16))
    extra = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids, **extra).loss.item()
    return {
        "dir": str(model_dir),
        "files": {p.name: round(p.stat().st_size / 1e9, 3) for p in files},
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "load_s": round(load_s, 1),
        "forward_loss": round(loss, 4),
        "loss_is_finite": math.isfinite(loss),
        "host_rss_gib": round(psutil.Process().memory_info().rss / GIB, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    record = check(args.model_dir)
    line = json.dumps(record)
    print("EXPORT " + line, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "export-check.json").write_text(line + "\n")
    return 0 if record["loss_is_finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
