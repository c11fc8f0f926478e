"""A user's own model directories: tiny random-weight models of the architectures people fine-tune, each
saved with `save_pretrained` beside a BPE tokenizer trained here, as a user's directory would hold them.

`tokenizer(path, bos=...)` saves a tokenizer that adds a BOS token (Llama 3, Gemma, Mistral, OPT style) or
one that adds none (Qwen, GPT-NeoX style); `model_dir(arch, path, bos=...)` saves a model beside one.
Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256)
# model_type -> config fields beyond SMALL; `causal` says which Auto class loads it
CAUSAL: dict[str, dict[str, Any]] = {
    "llama3": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "llama3-tied": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", num_key_value_heads=2, head_dim=16),
    "gemma3": dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=16),
    "phi3": dict(model_type="phi3", num_key_value_heads=2),
    "gpt_neox": dict(model_type="gpt_neox"),
    "falcon": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2),
    "opt": dict(model_type="opt", ffn_dim=128, word_embed_proj_dim=64),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "olmoe": dict(model_type="olmoe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
}
SEQ2SEQ: dict[str, dict[str, Any]] = {
    "t5-v1_1": dict(model_type="t5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0),
    "mt5": dict(model_type="mt5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                tie_word_embeddings=False, decoder_start_token_id=0),
    "bart": dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 max_position_embeddings=256),
}
ARCHITECTURES = [*CAUSAL, *SEQ2SEQ]
NO_BOS = {"qwen2", "qwen3", "gpt_neox", "qwen2_moe", "olmoe", "falcon"}  # Qwen / GPT-NeoX style tokenizers


def family_bos(arch: str) -> bool:
    """Whether `arch`'s own family's tokenizer adds a BOS token (seq2seq ones add none)."""
    return arch not in NO_BOS and arch not in SEQ2SEQ

_CORPUS = ["the quick brown fox jumps over the lazy dog", "three thousand six hundred thirty-one",
           "a user's own model trains correctly or is refused", "hello world, hello tokenizer",
           "fine-tune models too big for one GPU on one GPU", "nine hundred ninety-nine", "question: answer:"]


def tokenizer(path: Path, *, bos: bool, seq2seq: bool = False, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer and save it to `path`: `bos` adds `<s>` before every text (as Llama 3's
    and Gemma's do), seq2seq tokenizers append `</s>` (as T5's do). Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    single = ("<s> " if bos else "") + "$A" + (" </s>" if seq2seq else "")
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=single + " $B", special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>" if bos else None)
    fast.save_pretrained(path)
    return fast


def model_config(arch: str, vocab_size: int):
    """The tiny config of `arch` (a key of CAUSAL or SEQ2SEQ) for a tokenizer of `vocab_size` tokens."""
    from transformers import AutoConfig

    fields = {**(CAUSAL.get(arch) or SEQ2SEQ[arch])}
    model_type = fields.pop("model_type")
    base = {} if arch in SEQ2SEQ else dict(SMALL)
    return AutoConfig.for_model(model_type, **base, **fields, vocab_size=vocab_size, pad_token_id=0,
                                eos_token_id=1, bos_token_id=2)


def model_dir(arch: str, path: Path, *, bos: bool = True, seed: int = 0) -> Path:
    """Save a tiny random-weight `arch` model and its own tokenizer to `path`, as `save_pretrained` writes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = arch in SEQ2SEQ
    tok = tokenizer(path, bos=bos, seq2seq=seq2seq)
    config = model_config(arch, vocab_size=len(tok))
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_config(config)
    if (CAUSAL.get(arch) or SEQ2SEQ[arch]).get("tie_word_embeddings") is False:
        _untie_lm_head(model)
    model.save_pretrained(path)
    return path


def _untie_lm_head(model) -> None:
    """Give lm_head weights of its own. transformers 5 builds T5 and mT5 tied whatever the config says, but the
    hub's T5 v1.1, Flan-T5 and mT5 checkpoints hold lm_head apart, and from_pretrained loads them so."""
    import torch

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(torch.randn_like(head.weight) * 0.05)
        model.all_tied_weights_keys.pop("lm_head.weight", None)
