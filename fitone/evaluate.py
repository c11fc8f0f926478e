"""Held-out scoring during and after training: eval loss and token accuracy, and for seq2seq models the
exact match of greedy generations. Rank 0 scores; a score that runs out of GPU memory is skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fitone import memory
from fitone.data import IGNORE_INDEX, Dataset, collate
from fitone.engine import Engine
from fitone.metrics import MetricsLog
from fitone.models import CAUSAL, SEQ2SEQ


@dataclass
class HeldOut:
    """What scoring needs: the held-out rows and how to read and batch them."""

    data: Dataset
    examples: int  # how many of them to score
    answer_field: str | None  # the row field a seq2seq generation is compared with (exact match)
    batch: int  # no larger than the batches training has shown to fit
    pad_id: int
    tgt_len: int  # the longest generation


def score(engine: Engine, tokenizer: Any, held_out: HeldOut | None, *, step: int, say: Callable[[str], None],
          metrics: MetricsLog) -> dict[str, float]:
    """Evaluate now ({} without held-out data, and on ranks other than 0). A held-out score that runs out of
    GPU memory is skipped with a warning: it must not end (or lose) the training."""
    engine.sync_weights()  # the scores read the weights: an overlapped mode's pending update lands first
    if held_out is None:
        return {}
    try:
        result = evaluate(engine.module, tokenizer, held_out, engine.device)
    except Exception as exc:
        if not memory.is_oom_error(exc):
            raise
        engine.module.train()
        memory.free_memory()
        say(f"warning: held-out scoring at step {step} ran out of GPU memory and was skipped; training goes on "
            "(fewer --eval-examples or a smaller --batch-size would fit)")
        return {}
    n = min(held_out.examples, len(held_out.data))
    say("quality on " + f"{n} held-out examples: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
    metrics.write({"step": step, **result})  # `fitone report` draws it beside the loss
    return result


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, held_out: HeldOut, device: torch.device) -> dict[str, float]:
    """The quality numbers: eval loss and next-token accuracy per held-out token; exact match (seq2seq)."""
    data = held_out.data
    model.eval()
    n = min(held_out.examples, len(data))
    examples = data.examples[:n]
    hits, loss_sum, right, counted = 0, 0.0, 0, 0
    size = held_out.batch
    for i in range(0, n, size):
        chunk = examples[i:i + size]
        batch = {k: v.to(device) for k, v in collate(chunk, data.task, held_out.pad_id).items()}
        out = model(**batch)
        # next-token accuracy with the true prefix given (teacher forcing): moves long before exact match
        labels = batch["labels"][:, 1:] if data.task == CAUSAL else batch["labels"]
        guess = out.logits.argmax(-1)[:, : labels.shape[1]] if data.task == SEQ2SEQ else \
            out.logits.argmax(-1)[:, :-1]
        mask = labels != IGNORE_INDEX
        right += int((guess == labels)[mask].sum())
        counted += int(mask.sum())
        loss_sum += float(out.loss.float()) * int(mask.sum())  # the model's loss is the chunk's token mean
        if data.task == SEQ2SEQ:
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 max_new_tokens=held_out.tgt_len, do_sample=False, num_beams=1)
            texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            hits += sum(t.strip() == r[held_out.answer_field].strip() for t, r in zip(texts, data.raw[i:i + size]))
    model.train()
    # per held-out token, so the numbers do not depend on how the examples were chunked
    result = {"eval_loss": loss_sum / max(counted, 1), "token_accuracy": right / max(counted, 1)}
    if data.task == SEQ2SEQ:
        result["exact_match"] = hits / n
    return result
