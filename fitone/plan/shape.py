"""The model's shape, read from its config and a meta-device build (no weights): what the formulas need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitone.config import TrainConfig
from fitone.models import build_model, require_model
from fitone.packing import pack_refusal

_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need: sizes from the config, parameter counts from the meta model."""

    family: str  # "t5", "gpt2", "llama" or "generic"
    model_type: str
    encoder_decoder: bool
    n_params: int
    largest_param: int  # elements of the biggest single tensor (DeepSpeed sizes staging buffers by it)
    param_numels: tuple[int, ...]
    hidden: int
    layers: int
    decoder_layers: int
    heads: int
    kv_heads: int
    inner: int  # heads x head dim (T5's d_kv can differ from hidden / heads)
    ff: int
    vocab: int
    act: str
    gated: bool
    dropout: bool
    pack_refusal: str | None = None  # why --pack cannot train this causal LM exactly (fitone.packing); None: it can
    tied_embeddings: bool = False  # the LM head is the input embedding: its gradient sums over the whole backward

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder (T5 and the rest): no fused loss applies, its loss runs in the model's dtype."""
        return self.family == "t5" or self.encoder_decoder

    def fused(self, fused_loss: str | None) -> str | None:
        """The fused loss a run with this shape trains with: `fused_loss` on a causal LM, else None."""
        return None if self.seq2seq else fused_loss


def _first(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_shape(cfg: TrainConfig, config: Any) -> tuple[ModelShape, list[str]]:
    """Build the model of `config` (the run's: fitone.run) on the meta device and read its sizes. Returns the
    shape and notes for the user."""
    require_model(cfg.model)
    key = (cfg.model, cfg.from_scratch, config.to_json_string())
    if key not in _SHAPES:  # building even a meta model takes a second; a plan asks often
        if len(_SHAPES) >= 16:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = _model_shape(cfg.model, cfg.from_scratch, config)
    shape, notes = _SHAPES[key]
    return shape, list(notes)


_SHAPES: dict[tuple[str, bool, str | None], tuple[ModelShape, tuple[str, ...]]] = {}


def _model_shape(name: str, from_scratch: bool, config: Any) -> tuple[ModelShape, tuple[str, ...]]:
    notes: list[str] = []  # the config's own notes are the run's (fitone.run: Run.config_notes)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # shapes only: initialising billions of meta weights still costs seconds of CPU
        # as from_pretrained will load it: tied weights the checkpoint holds apart count twice
        model = build_model(config, meta=True, checkpoint=None if from_scratch else name)
    numels = tuple(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight

    mtype = getattr(config, "model_type", "") or ""
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    hidden = int(_first(config, ("d_model", "hidden_size", "n_embd")))
    heads = int(_first(config, ("num_heads", "num_attention_heads", "n_head"), max(1, hidden // 64)))
    head_dim = int(_first(config, ("d_kv", "head_dim"), hidden // heads))
    layers = int(_first(config, ("num_layers", "num_hidden_layers", "n_layer", "encoder_layers")))
    family = ("t5" if mtype in ("t5", "mt5") else "gpt2" if mtype == "gpt2" else "llama" if mtype in _LLAMA_LIKE
              else "generic")
    act = str(_first(config, ("dense_act_fn", "hidden_act", "activation_function"), "gelu"))
    dropout = any(float(_first(config, (n,), 0.0) or 0.0) > 0 for n in
                  ("dropout_rate", "resid_pdrop", "hidden_dropout", "dropout", "hidden_dropout_prob"))
    shape = ModelShape(
        family=family,
        model_type=mtype or "unknown",
        encoder_decoder=enc_dec,
        n_params=sum(numels),
        largest_param=max(numels),
        param_numels=numels,
        hidden=hidden,
        layers=layers,
        decoder_layers=int(_first(config, ("num_decoder_layers", "decoder_layers"), layers)) if enc_dec else 0,
        heads=heads,
        kv_heads=int(_first(config, ("num_key_value_heads",), heads)),
        inner=heads * head_dim,
        ff=int(_first(config, ("d_ff", "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim"), 4 * hidden)),
        vocab=int(config.vocab_size),
        act=act,
        gated=bool(getattr(config, "is_gated_act", False)) or family == "llama",
        dropout=dropout,
        pack_refusal=None if enc_dec else pack_refusal(config),
        tied_embeddings=tied,
    )
    if family == "generic":
        notes.append(f"no activation formula for model_type {shape.model_type!r}: used a generic one from hidden "
                     "size, layers and heads (GPT-2-like layers); expect activations within about ±30%")
    return shape, tuple(notes)
