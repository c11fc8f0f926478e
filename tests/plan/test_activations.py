"""The activation terms the plan cannot take from a formula alone, counted on the CPU: every tensor's bytes while
a real transformers model runs its forward and backward (a dispatch mode that sees each op's outputs and each
storage's release). Byte counts do not depend on the instruction set or the thread count."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fitone.plan.activations import Lengths, activation_moments
from fitone.plan.shape import ModelShape


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops made that are still alive, and the most of them at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def own_loss_bytes(vocab: int, tokens: int = 256, batch: int = 2) -> tuple[int, int]:
    """(bytes kept after the forward, the most alive in the backward) of a one-layer Llama's own loss in bf16,
    beyond its weights (frozen, so no weight gradient is counted)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=tokens)
    model = LlamaForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    ids = torch.randint(0, vocab, (batch, tokens))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    live = LiveBytes()
    with live:
        loss = model(inputs_embeds=embeds, labels=ids).loss
        kept = live.now
        live.peak = live.now
        loss.backward()
    return kept, live.peak


def test_a_causal_lms_own_loss_keeps_4_bytes_a_logit_and_peaks_at_12_as_the_plan_counts():
    """transformers' ForCausalLMLoss upcasts the logits to fp32; the log-softmax keeps its fp32 output (4 B a
    logit), and its backward holds that, its incoming gradient and the input's gradient at once (12 B). The
    plan's loss moment grows by the same 12 B for each logit more (two vocabularies, the rest alike). Counted
    with two micro-batches apart, so the LM head's own bytes (a copy of it scales with the vocabulary) cancel."""
    # two samples more: their 2 x 256 x 16,000 logits, and a few hundred bytes a token of the tiny layer's
    (kept_a, peak_a), (kept_b, peak_b) = own_loss_bytes(16000, batch=2), own_loss_bytes(16000, batch=4)
    logits = 2 * 256 * 16000
    assert (kept_b - kept_a) / logits == pytest.approx(4, abs=0.2)
    assert (peak_b - peak_a) / logits == pytest.approx(12, abs=0.2)
    shape = ModelShape(family="llama", model_type="llama", encoder_decoder=False, n_params=0, largest_param=0,
                       param_numels=(), hidden=64, layers=1, decoder_layers=1, heads=4, kv_heads=4, inner=64,
                       ff=128, vocab=8000, act="silu", gated=True, dropout=False)
    lengths = Lengths(src=256, tgt=256)
    planned = [activation_moments(dataclasses.replace(shape, vocab=v), precision="bf16", checkpointing=True,
                                  lengths=lengths)["loss"] for v in (8000, 16000)]
    assert (planned[1] - planned[0]) / (256 * 8000) == 12  # a sample's 256 tokens x 8,000 logits more
