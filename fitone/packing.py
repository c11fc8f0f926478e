"""Which causal LMs `--pack` trains exactly: the model types and attention implementations whose packed rows
give each example the logits it has alone, and the one-line refusal for every other model.

A packed row carries no attention mask; transformers finds its examples from position ids that restart at
0 (masking_utils' packed-sequence mask). A model that builds its mask without the position ids (OPT), or
adds a bias that runs across the row (Falcon's ALiBi), lets one example change another's logits.
tests/test_packing.py runs every entry here, and every refused one, on the CPU; flash attention cannot run
there, so it is not listed (refused) until proven.
"""

from __future__ import annotations

from typing import Any

from fitone.errors import ConfigError

_BOTH = frozenset({"eager", "sdpa"})
# model_type -> the attention implementations that pack exactly (under the installed transformers 5.x)
EXACT: dict[str, frozenset[str]] = {
    "gpt2": _BOTH, "llama": _BOTH, "mistral": _BOTH, "qwen2": _BOTH, "qwen3": _BOTH,
    "gemma2": frozenset({"eager"}),  # transformers has no sdpa for Gemma 2
    "gemma3_text": _BOTH, "phi3": _BOTH, "gpt_neox": _BOTH, "falcon": _BOTH, "mixtral": _BOTH,
    "qwen2_moe": _BOTH, "olmoe": _BOTH,
}
# what the tests see go wrong where a model type, or a config switch of a listed one, is refused
LEAKS: dict[str, str] = {
    "opt": "transformers' OPT builds its attention mask without the position ids that separate the examples",
}
SWITCHES: dict[tuple[str, str], str] = {
    ("falcon", "alibi"): "its ALiBi biases count positions across the whole row, not per example",
}


def attention_of(config: Any) -> str:
    """The attention implementation a causal LM of `config` gets from transformers: the one the config asks
    for, else sdpa where the model class has it, else eager (transformers' own default and fallback)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    asked = getattr(config, "_attn_implementation", None)
    if asked:
        return asked
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not a causal LM transformers knows: loading says so; here, the plain implementation
        return "eager"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def pack_refusal(config: Any) -> str | None:
    """Why --pack cannot train this model exactly, as one line naming the fix; None where it can."""
    model_type = getattr(config, "model_type", "") or "unknown"
    attention = attention_of(config)
    for (kind, switch), why in SWITCHES.items():
        if model_type == kind and getattr(config, switch, False):
            return f"--pack is not exact for {model_type} with {switch}: {why}; drop --pack"
    if attention in EXACT.get(model_type, ()):
        return None
    if model_type in LEAKS:
        return f"--pack lets a packed row's examples see each other in {model_type}: {LEAKS[model_type]}; drop --pack"
    proven = ", ".join(f"{t} ({'/'.join(sorted(a))})" for t, a in sorted(EXACT.items()))
    return (f"--pack is not proven exact for {model_type} with {attention} attention; it is for {proven}: "
            "drop --pack")


def require_exact_packing(config: Any) -> None:
    """Refuse --pack, before any weights load, for a model whose packed examples would not train as alone."""
    refusal = pack_refusal(config)
    if refusal:
        raise ConfigError(refusal)
