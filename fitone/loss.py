"""The causal LM loss without the logits: the LM head and the cross-entropy fused, so a 128k-152k-token
vocabulary costs no `[tokens, vocab]` activations.

transformers' causal LMs compute `lm_head(hidden)` for every token, upcast it to fp32 and keep both for the
loss's backward: at seq 512 that is most of a Llama-3.1-8B sample's activations. `install` swaps the
training forward of a causal LM for one that runs the model's backbone, then the head and the loss
together, in one of two ways:

- `liger`: Liger-Kernel's fused linear + cross-entropy (Triton), on a CUDA GPU in bf16 or fp32, where
  `liger-kernel` is installed. It computes the gradients during the forward at a loss scale of 1, so it is
  not used in fp16 (small gradients would underflow there before the loss scale reaches them).
- `chunked` (everywhere else, the CPU included): plain PyTorch, a few hundred tokens at a time. The forward
  keeps only the loss; the backward recomputes each chunk's logits and takes their gradient as the plain
  loss does (fp32 softmax, cast to the model's dtype, then the two matmuls), with the incoming gradient (the
  fp16 loss scale) applied before the cast, where the plain loss applies it.

Evaluation and generation keep the model's own forward (they need the logits). Only architectures whose own
forward is exactly "backbone, head, shifted cross-entropy" are swapped (`FUSED_LOSS_TYPES`, each checked
against the model's own loss in tests/test_loss.py); the rest keep their forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

IGNORE = -100
DESCRIPTIONS = {"liger": "Liger-Kernel", "chunked": "chunked, plain PyTorch"}
CHUNK_ELEMENTS = 2**25  # logits per chunk: about 10 bytes each at the backward's peak (fp32 logits, softmax, casts)

# model_type -> the config field holding its final-logit soft cap (None: no cap). Each is tested against the
# model's own loss; a type not here keeps its own forward (a logit scale, an auxiliary loss, a head of its own).
FUSED_LOSS_TYPES: dict[str, str | None] = {
    "llama": None, "mistral": None, "qwen2": None, "qwen3": None, "phi3": None, "gpt_neox": None,
    "falcon": None, "opt": None, "gemma": None, "gemma2": "final_logit_softcapping",
    "gemma3_text": "final_logit_softcapping", "mixtral": None, "qwen2_moe": None, "qwen3_moe": None,
    "olmoe": None,
}


# On a GPU a vocabulary below this keeps the model's own loss: at llama-7b's 32,000 tokens its logits are small
# and Liger's fused kernel was no faster (bench/results/2026-12-02b-gpu/); at 128k-152k the logits are most of
# a sample's activations and the fused loss is what lets the micro-batch grow.
FUSED_MIN_VOCAB_GPU = 65_536


def fused_loss_backend(config: Any, *, device: str, precision: str, by_vocab: bool = True) -> str | None:
    """The fused loss a causal LM with this config trains with ('liger' or 'chunked'), or None where it keeps
    its own forward (a model type not in FUSED_LOSS_TYPES, one that adds its router's auxiliary loss, or a
    small vocabulary on a GPU; `by_vocab=False`: whatever the vocabulary)."""
    return backend_for(getattr(config, "model_type", ""), device=device, precision=precision,
                       encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
                       router_loss=bool(getattr(config, "output_router_logits", False)),
                       vocab_size=getattr(config, "vocab_size", None) if by_vocab else None)


def small_vocab_on_gpu(vocab_size: int | None, device: str) -> bool:
    """Whether the model's own loss is kept because the vocabulary is small (see FUSED_MIN_VOCAB_GPU)."""
    return device == "cuda" and vocab_size is not None and vocab_size < FUSED_MIN_VOCAB_GPU


def note(config: Any, backend: str | None, *, device: str, precision: str, enabled: bool) -> str | None:
    """The run's line on which loss it trains with, where that is not the model's own by the user's choice."""
    if backend is not None:
        return (f"loss: the LM head and cross-entropy fused ({DESCRIPTIONS[backend]}), so no [tokens, vocab] "
                "logits are kept; --no-fused-loss for the model's own")
    if enabled and fused_loss_backend(config, device=device, precision=precision, by_vocab=False) is not None:
        return (f"loss: the model's own: a {config.vocab_size:,}-token vocabulary's logits are small, and on a GPU "
                f"the fused loss is for vocabularies of {FUSED_MIN_VOCAB_GPU:,} tokens or more")
    return None


def backend_for(model_type: str, *, device: str, precision: str, encoder_decoder: bool = False,
                router_loss: bool = False, vocab_size: int | None = None) -> str | None:
    """fused_loss_backend from the few facts it reads (the plan has a model's shape, not always its config)."""
    if encoder_decoder or model_type not in FUSED_LOSS_TYPES or router_loss or small_vocab_on_gpu(vocab_size, device):
        return None
    if device == "cuda" and precision in ("bf16", "fp32") and liger_available():
        return "liger"
    return "chunked"


def prepare(model: torch.nn.Module, *, device: str, precision: str, enabled: bool = True) -> str | None:
    """Install the fused loss on `model` where its architecture has one and `enabled`; returns the backend."""
    backend = fused_loss_backend(model.config, device=device, precision=precision) if enabled else None
    if backend is not None:
        install(model, backend)
    return backend


def liger_available() -> bool:
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception:  # not installed, or no Triton (a CPU-only machine)
        return False
    return True


def install(model: torch.nn.Module, backend: str) -> None:
    """Train `model` (a transformers causal LM) with the fused loss: in training mode with labels, its forward
    returns only `.loss`; otherwise it is the model's own forward."""
    head = model.get_output_embeddings()
    field = FUSED_LOSS_TYPES[model.config.model_type]
    softcap = getattr(model.config, field, None) if field else None
    own_forward = model.forward

    def forward(self, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None or not self.training or args:
            return own_forward(*args, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = getattr(self, self.base_model_prefix)(**kwargs)[0]
        # the shifted labels, as transformers' ForCausalLMLoss: position t predicts token t + 1
        return CausalLMOutputWithPast(loss=head(hidden[:, :-1], labels=labels[:, 1:]))

    def head_forward(self: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # called through the module, so forward pre-hooks on the head (the pipelined update's wait) still run
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        return linear_cross_entropy(hidden, self.weight, labels, bias=self.bias, softcap=softcap, backend=backend)

    model.forward = types.MethodType(forward, model)
    head.forward = types.MethodType(head_forward, head)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, softcap: float | None = None,
                         backend: str = "chunked") -> torch.Tensor:
    """mean over labels != -100 of cross_entropy(hidden @ weight.T + bias, labels), upcast to fp32 as
    transformers does, without materialising the logits of every token at once."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if backend == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, softcap=softcap)(weight, hidden, labels, bias)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, softcap)


def _chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of a chunk as the plain path makes them (the matmul in the model's dtype, then the upcast),
    and tanh(z / cap) where a soft cap applies (its backward needs it)."""
    z = F.linear(hidden, weight, bias).float()
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
        rows = (labels != IGNORE).nonzero().squeeze(1)  # ignored tokens add nothing to the loss or the gradients
        h, y = hidden.index_select(0, rows), labels.index_select(0, rows)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_tokens(weight.shape[0])
        with torch.no_grad():
            for s in range(0, h.shape[0], step):
                z, _ = _logits(h[s:s + step], weight, bias, softcap)
                total += F.cross_entropy(z, y[s:s + step], reduction="sum")
        ctx.save_for_backward(h, weight, bias, y, rows)
        ctx.softcap, ctx.tokens, ctx.hidden_shape = softcap, hidden.shape[0], hidden.shape
        return total / rows.numel()  # 0 / 0 = nan where nothing is labelled, as the plain mean

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, y, rows = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad_out.float() / rows.numel()
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        step = _chunk_tokens(weight.shape[0])
        for s in range(0, h.shape[0], step):
            hc, yc = h[s:s + step], y[s:s + step]
            z, t = _logits(hc, weight, bias, ctx.softcap)
            g = torch.softmax(z, dim=-1)
            del z
            g[torch.arange(yc.numel(), device=g.device), yc] -= 1.0
            g.mul_(scale)
            if t is not None:
                g.mul_(1.0 - t * t)  # d(cap * tanh(z / cap)) / dz
            g = g.to(h.dtype)  # the plain path's logits are in the model's dtype: their gradient is too
            if grad_h is not None:
                grad_h[s:s + step] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), hc)
            if grad_b is not None:
                grad_b += g.sum(0)
        full_h = None
        if grad_h is not None:
            full_h = torch.zeros(ctx.hidden_shape, dtype=h.dtype, device=h.device).index_copy_(0, rows, grad_h)
        return full_h, grad_w, grad_b, None, None
