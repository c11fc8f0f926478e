"""Activation bytes of one sample in forward + backward, per model family (T5, GPT-2, Llama-style, generic)."""

from __future__ import annotations

from dataclasses import dataclass

from fitone.loss import CHUNK_ELEMENTS
from fitone.plan.shape import ModelShape

# Backward of a recomputed layer holds about three quarters of one FF-sized gradient on top of the
# layer's saved tensors (fitted to the checkpointed t5-3b runs at 128/128 and 256/64, within 2%).
BACKWARD_TRANSIENT_FF = 0.75

# ff-sized tensors an activation function saves for its backward (HF's ACT2FN implementations).
_ACT_SAVED = {"relu": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "quick_gelu": 2,
              "gelu_new": 4, "gelu_fast": 5}
_SAVES_OUTPUT = {"relu"}  # relu keeps its output, which the next op would have kept anyway


@dataclass(frozen=True)
class Lengths:
    src: int  # encoder tokens (seq2seq) or the sequence (causal)
    tgt: int  # decoder tokens (seq2seq); equal to src for causal models


def _ff_saved(s: ModelShape, a: int, mlp_dropout: bool) -> float:
    """Bytes per token the feed-forward keeps: activation, gate product, dropout mask and output."""
    act_saved = _ACT_SAVED.get(s.act, 1)
    out_kept = s.act in _SAVES_OUTPUT and not s.gated and not mlp_dropout
    total = act_saved * a * s.ff
    if s.gated:
        total += 2 * a * s.ff  # the mul keeps act(gate) and up
    if mlp_dropout:
        total += s.ff + a * s.ff  # bool mask + the dropped output the down projection keeps
    elif not out_kept:
        total += a * s.ff  # the down projection keeps its input
    return total


def _t5_layers(s: ModelShape, a: int, fp16: bool, lengths: Lengths) -> tuple[float, float, float, float]:
    """(encoder layer, decoder layer, encoder head, decoder head) in bytes per token, for T5.

    T5's learned position bias needs a gradient, so SDPA runs its math kernel for self-attention:
    q, k, v upcast to fp32 and fp32 scores (softmax, dropout mask, dropped scores) are kept. Cross-attention
    has no learned bias and keeps only q, k, v, out (a fused kernel). LayerNorm keeps an fp32 copy of its
    input; in fp16 every sublayer clamps (keeping its input).
    """
    d, inner, h = s.hidden, s.inner, s.heads
    drop = 1 if s.dropout else 0
    f32 = 4 * d if a < 4 else 0
    clamp = a * d if fp16 else 0
    norm = a * d + f32 + 2 * a * d  # input, fp32 copy, rescaled, weighted
    r = lengths.src / lengths.tgt

    def self_attn(keys: int) -> float:
        return norm + 12 * inner + (4 + 5 * drop) * h * keys + a * inner + drop * d + clamp

    cross = norm + a * inner + 2 * a * inner * r + a * inner + 4 * h + drop * d + clamp
    ff = norm + _ff_saved(s, a, mlp_dropout=bool(drop)) + drop * d + clamp
    enc = self_attn(lengths.src) + ff
    dec = self_attn(lengths.tgt) + cross + ff
    head = 2 * drop * d + f32 + 3 * a * d  # embedding dropout, final norm, final dropout
    return enc, dec, head, head + a * d  # the decoder's final output also feeds the LM head


def _decoder_layer(s: ModelShape, a: int) -> tuple[float, float]:
    """(layer, head without the loss) in bytes per token, for GPT-2, Llama-style and generic decoders."""
    d, h = s.hidden, s.heads
    drop = 1 if s.dropout else 0
    if s.family == "llama":
        norm = 2 * a * d + 4 * d  # fp32 copy of the input, rescaled, weighted
        kv = 2 * a * d * s.kv_heads / s.heads
        layer = 2 * norm + a * d + kv + a * d + 4 * h + _ff_saved(s, a, mlp_dropout=False)
        return layer, norm
    # GPT-2 (and generic): LayerNorm input + output, fused qkv, q/v/out copies the fused kernel wants,
    # residual dropout masks, MLP
    layer = 10 * a * d + 2 * drop * d + 16 + 4 * h + _ff_saved(s, a, mlp_dropout=False)
    return layer, drop * d + 2 * a * d + 8


def activation_bytes(s: ModelShape, *, precision: str, checkpointing: bool, lengths: Lengths,
                     fused_loss: str | None = None) -> int:
    """Peak activation bytes of one sample in forward + backward (the micro-batch scales it linearly): the
    larger of `activation_moments`."""
    return max(activation_moments(s, precision=precision, checkpointing=checkpointing, lengths=lengths,
                                  fused_loss=fused_loss).values())


def activation_moments(s: ModelShape, *, precision: str, checkpointing: bool, lengths: Lengths,
                       fused_loss: str | None = None) -> dict[str, int]:
    """Activation bytes of one sample at the backward's high moments: "loss" (the loss's backward: everything
    kept + the logits' gradients) and, with checkpointing, "layers" (the backward of a recomputed layer; the
    forward never gets higher). The plan adds what only the loss's moment holds (a fused loss's chunk, the LM
    head's gradient) to that moment alone. Logits are not kept past the loss (fitone keeps only `.loss`).
    Causal LMs upcast logits to fp32 for the loss (transformers' ForCausalLMLoss); T5 computes it in the
    model's dtype. With a fused loss (fitone.loss) a causal LM keeps no logits: the loss keeps the labelled
    hidden states and backward makes their gradient (the chunked path) or the forward makes it (Liger, which
    also keeps fp32 logits of about H per token); the fixed part of either is `fused_loss_fixed_bytes`.
    """
    a = 4 if precision == "fp32" else 2
    fp16 = precision == "fp16"
    if s.seq2seq:
        if s.family == "t5":
            enc, dec, head_e, head_d = _t5_layers(s, a, fp16, lengths)
        else:  # generic encoder-decoder: decoder-style layers plus a cross-attention on the decoder side
            enc, head_e = _decoder_layer(s, a)
            dec = enc + 6 * a * s.hidden + 2 * a * s.hidden * lengths.src / lengths.tgt + 4 * s.heads
            head_d = head_e + a * s.hidden
        loss_dtype, loss_grad_copies = a, 2  # the log-softmax's incoming gradient and the logits' gradient
        src, tgt = lengths.src, lengths.tgt
        l_enc, l_dec = s.layers, s.decoder_layers
    else:
        dec, head_d = _decoder_layer(s, a)
        enc, head_e, src, l_enc = 0.0, 0.0, 0, 0
        # a causal LM's fp32 loss peaks in the log-softmax's backward: its kept output, its incoming gradient and
        # the input's, 12 B a logit (counted on the CPU: tests/plan/test_activations.py)
        loss_dtype, loss_grad_copies, tgt, l_dec = 4, 2, lengths.tgt, s.layers
    lsm = loss_dtype * s.vocab * tgt  # log-softmax output kept for the loss backward
    loss_grads = loss_grad_copies * loss_dtype * s.vocab * tgt
    if s.fused(fused_loss):
        lsm = a * s.hidden * tgt  # the labelled hidden states, gathered
        loss_grads = a * s.hidden * tgt + (8 * s.hidden * tgt if fused_loss == "liger" else 0)
    transient = BACKWARD_TRANSIENT_FF * a * s.ff

    if not checkpointing:
        kept = (l_enc * enc + head_e) * src + (l_dec * dec + head_d) * tgt + lsm
        return {"loss": int(kept + loss_grads)}
    # with checkpointing each layer keeps only its input until backward recomputes it
    kept_enc = (l_enc * a * s.hidden + head_e) * src
    kept_dec = (l_dec * a * s.hidden + head_d) * tgt
    loss_phase = kept_enc + kept_dec + lsm + loss_grads
    dec_phase = kept_enc + kept_dec - a * s.hidden * tgt + (dec + transient) * tgt
    enc_phase = kept_enc + a * s.hidden * src + (enc + transient) * src if l_enc else 0.0
    return {"loss": int(loss_phase), "layers": int(max(dec_phase, enc_phase))}


def fused_loss_fixed_bytes(s: ModelShape, *, precision: str, fused_loss: str | None) -> int:
    """What a fused loss holds whatever the micro-batch: the chunked path's one chunk of logits in backward
    (16-bit logits, their fp32 copy, the softmax and its 16-bit cast: 12 B each), or nothing more for Liger:
    its head gradient, made in the forward and handed on in the loss's backward, is the LM head's gradient
    the plan counts at that moment anyway (measured: bench/results/2026-12-01-issue27/llama-3.1-8b/). Only
    the loss's moment holds it: the layers' backward comes after."""
    if s.fused(fused_loss) in (None, "liger"):
        return 0
    return 12 * CHUNK_ELEMENTS
