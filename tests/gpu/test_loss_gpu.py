"""The fused LM head + cross-entropy (fitone.loss) on the GPU against the plain loss: Liger-Kernel's (bf16) and
the chunked path (bf16 and fp16 with a loss scale), with a 32k vocabulary, on a batch of 4 x 512 tokens.

The bound, per element of a gradient G with |G|max its largest magnitude in the plain run: both paths form the
fp32 gradient of the logits from the same 16-bit logits (cuBLAS may block the head's matmul differently, a
rounding of the logits, which the softmax carries at most twice) and cast it to 16 bits (one unit roundoff u);
the head's gradient then sums over the tokens in one matmul (plain) or per chunk, each rounded to 16 bits
(chunked; Liger accumulates in the weight's dtype too): one rounding of |G|max per chunk. So
|got - want| <= (chunks + 4) x u x |G|max. The loss moves by at most the logits' rounding: 4 u x its value.
"""

from __future__ import annotations

import pytest
import torch
from gpu_lane import needs_cuda, record

from fitone import loss as fused

pytestmark = [pytest.mark.gpu, needs_cuda]

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOKENS, HIDDEN, VOCAB = 4 * 512, 1024, 32000


def _inputs(precision: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = DTYPES[precision]
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    labels[:300] = fused.IGNORE  # a prompt that is not trained on
    return hidden, weight, labels


def _run(precision: str, backend: str | None, scale: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    hidden, weight, labels = _inputs(precision)
    hidden.requires_grad_()
    weight.requires_grad_()
    if backend is None:
        loss = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=fused.IGNORE)
    else:
        loss = fused.linear_cross_entropy(hidden, weight, labels, backend=backend)
    (loss * scale).backward()
    return float(loss), hidden.grad.float() / scale, weight.grad.float() / scale


@pytest.mark.parametrize("precision,backend,scale", [("bf16", "liger", 1.0), ("bf16", "chunked", 1.0),
                                                     ("fp16", "chunked", 2.0**16)])
def test_the_fused_loss_equals_the_plain_loss_on_the_gpu(precision, backend, scale):
    if backend == "liger" and not fused.liger_available():
        pytest.skip("liger-kernel is not installed")
    want_loss, want_h, want_w = _run(precision, None, scale)
    got_loss, got_h, got_w = _run(precision, backend, scale)
    u = UNIT_ROUNDOFF[precision]
    if backend == "chunked":
        chunks = -(-(TOKENS - 300) // fused._chunk_tokens(VOCAB))
    else:  # Liger's chunks: tokens / next_pow2(tokens / ceil(V / H)) (liger_kernel.ops.fused_linear_cross_entropy)
        chunk = 1 << (-(-TOKENS // -(-VOCAB // HIDDEN)) - 1).bit_length()
        chunks = -(-TOKENS // chunk)
    gaps = {}
    for name, got, want in (("hidden", got_h, want_h), ("weight", got_w, want_w)):
        bound = (chunks + 4) * u * float(want.abs().max())
        gaps[name] = (float((got - want).abs().max()), bound)
    record("fused_loss", precision=precision, backend=backend, loss=[got_loss, want_loss], gaps=gaps)
    assert abs(got_loss - want_loss) <= 4 * u * abs(want_loss), (got_loss, want_loss)
    for name, (gap, bound) in gaps.items():
        assert gap <= bound, (name, gap, bound)
    assert float(got_h.abs().max()) > 0 and float(got_w.abs().max()) > 0


@pytest.mark.parametrize("vocab", [32_000, 128_256])
def test_a_small_vocabulary_keeps_the_models_own_loss_on_the_gpu_and_a_large_one_fuses_it(vocab):
    """The vocabulary rule (fitone.loss.FUSED_MIN_VOCAB_GPU) on a real CUDA model: below it the model's forward
    is untouched; above it the fused forward is installed and gives the model's own loss (bf16, one step's batch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, vocab, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = float(model(input_ids=ids, labels=ids).loss)
    backend = fused.prepare(model, device="cuda", precision="bf16")
    line = fused.note(model.config, backend, device="cuda", precision="bf16", enabled=True)
    got = model(input_ids=ids, labels=ids)
    record("vocab_rule", vocab=vocab, backend=backend, loss=[float(got.loss), want], note=line)
    if vocab < fused.FUSED_MIN_VOCAB_GPU:
        assert backend is None and "model's own" in line
        assert got.logits is not None  # the model's own forward, logits and all
    else:
        assert backend in ("liger", "chunked") and line.startswith("loss: the LM head and cross-entropy fused")
        assert got.logits is None
    assert abs(float(got.loss) - want) <= 4 * UNIT_ROUNDOFF["bf16"] * abs(want), (float(got.loss), want)
