"""Load or build models and tokenizers, and switch on activation checkpointing.

`--model NAME` with `--from-scratch` builds the architecture from a config shipped in
`fitone/model_configs/` (random weights, nothing downloaded); without it, `from_pretrained` loads a
hub id or a local directory. The task (seq2seq or causal LM) follows from the model config.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import socket
import threading
import urllib.parse
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    ByT5Tokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from fitone.errors import ConfigError, ModelError

CONFIG_DIR = Path(__file__).parent / "model_configs"

SEQ2SEQ = "seq2seq"
CAUSAL = "causal"


def shipped_models() -> list[str]:
    """Names `--from-scratch` can build, found by globbing the shipped config folder."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def task_of(config: PretrainedConfig) -> str:
    return SEQ2SEQ if getattr(config, "is_encoder_decoder", False) else CAUSAL


def load_config(name: str, *, from_scratch: bool) -> PretrainedConfig:
    """The model's config: shipped (from scratch, or a local dir/hub id) without touching weights."""
    if from_scratch and name in shipped_models():
        values = json.loads((CONFIG_DIR / f"{name}.json").read_text())
        return AutoConfig.for_model(**values)
    if from_scratch and Path(name, "config.json").is_file():
        return AutoConfig.from_pretrained(name)
    if from_scratch:
        raise ModelError(
            f"no shipped config named {name!r} for --from-scratch; choose one of {', '.join(shipped_models())} "
            "or give a directory holding a config.json"
        )
    try:
        return AutoConfig.from_pretrained(name, **hub_options(name))
    except (OSError, ValueError) as exc:
        raise ModelError(_not_found(name)) from exc


HUB_CHECK_S = 3.0  # how long to wait for the hub's address before calling it unreachable


def hub_options(name: str) -> dict[str, Any]:
    """from_pretrained's options for `name`: local files only where the hub cannot be asked.

    Without HF_HUB_OFFLINE and without a network, huggingface_hub retries each request with backoff
    (eleven warning lines over ~28 s) before the same "not found". One connection attempt, once per
    process, decides instead; a local directory never asks the hub."""
    if Path(name).is_dir():
        return {}
    return {"local_files_only": True} if _hub_offline() else {}


@functools.cache
def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    answered, reached = threading.Event(), []

    def connect() -> None:  # in a thread: a name lookup may hang longer than any socket timeout
        try:
            socket.create_connection((url.hostname, port), timeout=HUB_CHECK_S).close()
            reached.append(True)
        except OSError:
            pass
        finally:
            answered.set()

    threading.Thread(target=connect, daemon=True).start()
    answered.wait(HUB_CHECK_S)
    return not reached


def _not_found(name: str) -> str:
    local = Path(name).exists() or name.startswith((".", "/", "~"))
    where = "local directory" if local else "model id"
    hint = "; or add --from-scratch to build it with random weights" if name in shipped_models() else ""
    return (
        f"cannot load {where} {name!r}: not a directory with config.json and not in the local Hugging Face cache "
        f"(no network or unknown id): give a local path saved with save_pretrained{hint}"
    )


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any
    task: str
    config: PretrainedConfig

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build_model(config: PretrainedConfig, *, meta: bool = False, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Random-weight model from a config; on the meta device (no memory) when `meta`."""
    auto = AutoModelForSeq2SeqLM if task_of(config) == SEQ2SEQ else AutoModelForCausalLM
    if meta:
        from accelerate import init_empty_weights

        ctx = init_empty_weights()
    else:
        ctx = nullcontext()
    with ctx:
        model = auto.from_config(config, dtype=dtype) if dtype else auto.from_config(config)
    model.tie_weights()  # init_empty_weights leaves tied embeddings untied
    return model


def require_model(name: str | None) -> str:
    """The one 'no model given' check, for every entry (train, probe, plan, load_model)."""
    if not name:
        raise ConfigError("no model given: pass --model NAME_OR_PATH (a hub id, a local dir, or a shipped name "
                          "with --from-scratch) or --recipe NAME")
    return name


def load_model(name: str, *, from_scratch: bool, seed: int = 0, config: PretrainedConfig | None = None) -> LoadedModel:
    """Weights and tokenizer: pretrained from a hub id / local dir, or built from a config. `config`: the
    model config the caller already loaded (else it is loaded here)."""
    require_model(name)
    if config is None:
        config = load_config(name, from_scratch=from_scratch)
    if from_scratch:
        torch.manual_seed(seed)
        model = build_model(config)
    else:
        auto = AutoModelForSeq2SeqLM if task_of(config) == SEQ2SEQ else AutoModelForCausalLM
        try:
            model = auto.from_pretrained(name, **hub_options(name))
        except (OSError, ValueError) as exc:
            raise ModelError(_not_found(name) + f" ({exc.__class__.__name__})") from exc
    tokenizer = load_tokenizer(name, config)
    return LoadedModel(model=model, tokenizer=tokenizer, task=task_of(config), config=config)


def load_tokenizer(name: str, config: PretrainedConfig):
    """The model's own tokenizer where it has one, else the ByT5 byte tokenizer (needs no files)."""
    has_files = Path(name).is_dir() and any(
        (Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json")
    )
    if has_files or (not Path(name).is_dir() and name not in shipped_models()):
        try:
            tok = AutoTokenizer.from_pretrained(name, **hub_options(name))
        except (OSError, ValueError):
            tok = ByT5Tokenizer()
    else:
        tok = ByT5Tokenizer()
    if tok.pad_token_id is None:  # causal LMs such as gpt2 ship without a pad token
        tok.pad_token = tok.eos_token
    if len(tok) > config.vocab_size and isinstance(tok, ByT5Tokenizer) is False:
        raise ModelError(f"tokenizer of {name!r} has {len(tok)} tokens but the model only {config.vocab_size}")
    return tok


def position_limit(config: PretrainedConfig) -> int | None:
    """Longest sequence a causal LM's position table holds; None where positions are relative (T5)."""
    if getattr(config, "model_type", "") in ("t5", "mt5", "umt5"):
        return None
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_seq_len(config: PretrainedConfig, seq_len: int, name: str) -> None:
    """A causal LM's --seq-len beyond its position table fails deep in forward (a device assert on a GPU)."""
    limit = position_limit(config)
    if task_of(config) == CAUSAL and limit is not None and seq_len > limit:
        raise ConfigError(f"--seq-len {seq_len} is beyond {name}'s {limit} positions: use --seq-len {limit} or less")


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward. HF models ignore DeepSpeed's own setting, so set it here."""
    kwargs = {"use_reentrant": False}
    new_api = getattr(model, "activation_checkpointing_enable", None)  # renamed in transformers 5.2x
    if new_api is not None and "activation_checkpointing_kwargs" in inspect.signature(new_api).parameters:
        new_api(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
