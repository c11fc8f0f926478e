"""Load or build models and tokenizers, and switch on activation checkpointing.

`--model NAME` with `--from-scratch` builds the architecture from a config shipped in
`fitone/model_configs/` (random weights, nothing downloaded); without it, `from_pretrained` loads a
hub id or a local directory. The task (seq2seq or causal LM) follows from the config's `architectures`
and model type; what is not a language model with an LM head is refused in one line (`load_config`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import socket
import threading
import urllib.parse
from contextlib import nullcontext
from dataclasses import dataclass, field
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
from transformers.models.auto import modeling_auto

from fitone.errors import ConfigError, ModelError

CONFIG_DIR = Path(__file__).parent / "model_configs"

SEQ2SEQ = "seq2seq"
CAUSAL = "causal"


def shipped_models() -> list[str]:
    """Names `--from-scratch` can build, found by globbing the shipped config folder."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _class_names(mapping: dict[str, Any]) -> set[str]:
    return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}


_CAUSAL_LM = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # model type -> its causal-LM class
_SEQ2SEQ_LM = modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
_CAUSAL_CLASSES, _SEQ2SEQ_CLASSES = _class_names(_CAUSAL_LM), _class_names(_SEQ2SEQ_LM)
_BASE_CLASSES = _class_names(modeling_auto.MODEL_MAPPING_NAMES)  # LlamaModel, T5Model: no LM head
# encoder models (BERT, RoBERTa...): transformers' "causal" head for them sees the whole sequence unless the
# config says is_decoder, so trained as a causal LM each position would learn from the tokens after it
_ENCODERS = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
# multimodal checkpoints whose text part fitone trains alone: the checkpoint's names of that part -> the
# text-only class's (transformers' older and newer layouts); their logits on text are the full model's
# (tests/test_models.py checks it)
_TEXT_PART_KEYS: dict[str, dict[str, str]] = {  # by the text part's model type
    "gemma3_text": {r"^language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
                    r"^language_model\.lm_head\.": "lm_head."},
}
_LM_ENDINGS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_FITS = "fitone fine-tunes causal LMs (...ForCausalLM) and seq2seq LMs (...ForConditionalGeneration)"


def _architecture(config: PretrainedConfig) -> str | None:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else None


def _head_of(arch: str) -> str:
    """'its sequence-classification head' for LlamaForSequenceClassification: the head a class name ends with."""
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", arch.rsplit("For", 1)[-1]).lower() if "For" in arch else "own"
    return f"its {words.replace(' ', '-')} head"


def task_of(config: PretrainedConfig, name: str | None = None) -> str:
    """SEQ2SEQ or CAUSAL, from the config's `architectures` (else its model type). Raises ModelError for what
    fitone cannot train as a language model: encoder-only and multimodal models, and heads other than an LM's
    (a classification head would be dropped and a random LM head trained in its place)."""
    name = name or getattr(config, "name_or_path", "") or "this model"
    arch, mtype = _architecture(config), getattr(config, "model_type", "") or ""
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    if any("vision" in k or "audio" in k for k in getattr(config, "sub_configs", {})):
        raise ModelError(f"{name} is multimodal ({arch or mtype}) and fitone trains text-only language models: "
                         "give a text-only checkpoint of it (its language model saved with save_pretrained)")
    if mtype in _ENCODERS and not enc_dec and not getattr(config, "is_decoder", False):
        raise ModelError(f"{name} is an encoder-only model ({arch or mtype}): its attention sees the whole sequence, "
                         f"so it cannot be trained as a causal LM; {_FITS}: give a decoder or encoder-decoder "
                         "checkpoint")
    if arch in _SEQ2SEQ_CLASSES and arch not in _CAUSAL_CLASSES:
        return SEQ2SEQ
    if arch in _CAUSAL_CLASSES:
        return CAUSAL
    # no head to lose (a base model: load_model says an LM head was added), or an LM's name transformers no longer
    # uses (the hub's t5-3b says T5WithLMHeadModel): the model type decides, as it does for from_pretrained
    if arch is None or arch in _BASE_CLASSES or arch.endswith(_LM_ENDINGS):
        if enc_dec and mtype in _SEQ2SEQ_LM:
            return SEQ2SEQ
        if mtype in _CAUSAL_LM:
            return CAUSAL
    if mtype not in _CAUSAL_LM and mtype not in _SEQ2SEQ_LM:
        raise ModelError(f"{name} is a {mtype!r} model ({arch or 'no architectures'}), not a language model: "
                         f"{_FITS}: give a language model's checkpoint")
    lm = _SEQ2SEQ_LM.get(mtype) if enc_dec else _CAUSAL_LM.get(mtype) or _SEQ2SEQ_LM.get(mtype)
    raise ModelError(f"{name} is a {arch}, not a language model with an LM head: trained as one, {_head_of(arch)} "
                     f"would be dropped and a random LM head trained in its place; {_FITS}: give the checkpoint it "
                     f"was fine-tuned from ({lm})")


def _text_part(config: PretrainedConfig, name: str) -> tuple[PretrainedConfig, str | None]:
    """A multimodal checkpoint whose text part fitone trains: that part's config, and the note saying so."""
    text = config.get_text_config(decoder=True)
    if text is config or getattr(text, "model_type", "") not in _TEXT_PART_KEYS:
        return config, None
    text.architectures = [_CAUSAL_LM[text.model_type]]
    return text, (f"{name} is multimodal ({_architecture(config)}): fitone trains its text part as "
                  f"{text.architectures[0]}; the vision tower and projector are left out of the run and of final/")


def config_and_notes(name: str, *, from_scratch: bool) -> tuple[PretrainedConfig, list[str]]:
    """`load_config`, and what a user should be told about it (a text part taken, an LM head added)."""
    config = _read_config(name, from_scratch=from_scratch)
    config, note = _text_part(config, name)
    task_of(config, name)  # refuses here, before anything reads its sizes
    notes = [note] if note else []
    if _architecture(config) in _BASE_CLASSES:
        tied = bool(getattr(config, "tie_word_embeddings", False))
        notes.append(f"{name} is a base {_architecture(config)} without an LM head: fitone adds one"
                     + (" tied to the input embeddings" if tied else ", which starts from random weights"))
    return config, notes


def load_config(name: str, *, from_scratch: bool) -> PretrainedConfig:
    """The model's config (shipped, from scratch, or a local dir/hub id) without touching weights. Refuses
    (ModelError) what fitone cannot train as a language model; of a multimodal checkpoint whose text part it
    trains, the text part's config."""
    return config_and_notes(name, from_scratch=from_scratch)[0]


def _read_config(name: str, *, from_scratch: bool) -> PretrainedConfig:
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


# hub checkpoints whose architecture a shipped config is, beyond those named like one (t5-3b, google-t5/t5-3b)
_SHIPPED_AS = {"meta-llama/Llama-2-7b-hf": "llama-7b", "meta-llama/Llama-2-13b-hf": "llama-2-13b"}


def shipped_twin(name: str) -> str | None:
    """The shipped config that builds `name`'s architecture (for --from-scratch), if fitone ships one."""
    shipped = shipped_models()
    for candidate in (name, name.rsplit("/", 1)[-1], _SHIPPED_AS.get(name)):
        if candidate in shipped:
            return candidate
    return None


def from_scratch_hint(twin: str) -> str:
    """How to build a shipped architecture with random weights, as a flag and as a recipe override."""
    return f"--model {twin} --from-scratch (in a recipe: model={twin} from_scratch=true)"


def _not_found(name: str) -> str:
    local = Path(name).exists() or name.startswith((".", "/", "~"))
    where = "local directory" if local else "model id"
    twin = None if local else shipped_twin(name)
    hint = f"; or build its architecture with random weights: {from_scratch_hint(twin)}" if twin else ""
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
    notes: list[str] = field(default_factory=list)  # what loading added or left out, for the user

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build_model(config: PretrainedConfig, *, meta: bool = False, dtype: torch.dtype | None = None,
                checkpoint: str | None = None, device: str | None = None) -> PreTrainedModel:
    """Random-weight model from a config, with the architecture's own init, made on `device` (default the CPU);
    on the meta device (no memory) when `meta`. `checkpoint`: the dir or hub id whose weights will load into it;
    tied weights it holds apart are built apart, as from_pretrained loads them."""
    auto = AutoModelForSeq2SeqLM if task_of(config) == SEQ2SEQ else AutoModelForCausalLM
    if meta:
        from accelerate import init_empty_weights

        ctx = init_empty_weights()
    else:
        ctx = torch.device(device) if device else nullcontext()
    with ctx:
        model = auto.from_config(config, dtype=dtype) if dtype else auto.from_config(config)
    model.tie_weights()  # init_empty_weights leaves tied embeddings untied
    for target in _untied_in(checkpoint, model) if checkpoint else ():
        parent, _, attr = target.rpartition(".")
        module = model.get_submodule(parent)
        setattr(module, attr, torch.nn.Parameter(torch.empty_like(getattr(module, attr))))
        model.all_tied_weights_keys.pop(target, None)
    return model


_COMPARED_ROWS = 8  # of two tied tensors: weights that differ do so in every row; reading all of mT5's costs GBs


def _untied_in(name: str, model: PreTrainedModel) -> list[str]:
    """The tied names (targets) that from_pretrained loads untied from `name`: both halves in the checkpoint with
    different values. T5 v1.1, Flan-T5 and mT5 checkpoints hold lm_head apart, though transformers 5 builds
    T5 tied whatever their config says; a checkpoint not on this machine is taken as its config says."""
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    try:
        rows = _checkpoint_rows(name, _TEXT_PART_KEYS.get(model.config.model_type, {}))
        return [t for t, s in tied.items() if t in rows and s in rows and not torch.equal(rows[t](), rows[s]())]
    except (OSError, RuntimeError, ValueError, KeyError):  # from_pretrained reports an unreadable checkpoint
        return []


def _checkpoint_rows(name: str, key_mapping: dict[str, str]) -> dict[str, Any]:
    """Tensor name (after `key_mapping`) -> a function reading its first rows, for the checkpoint files of a
    local dir or of a hub id already in the local cache; {} where there are none."""
    folder = Path(name)
    if not folder.is_dir():
        from transformers.utils import cached_file

        found = cached_file(name, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
        if not found:
            return {}
        folder = Path(found).parent
    # in from_pretrained's order of preference
    weights = next((f for f in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                                "pytorch_model.bin") if (folder / f).is_file()), None)
    if weights is None:
        return {}
    files: dict[str, str] = (json.loads((folder / weights).read_text())["weight_map"] if weights.endswith(".json")
                             else {key: weights for key in _tensor_names(folder / weights)})

    def rename(key: str) -> str:
        for pattern, to in key_mapping.items():
            key = re.sub(pattern, to, key)
        return key

    return {rename(k): functools.partial(_first_rows, folder / f, k) for k, f in files.items()}


def _tensor_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return list(f.keys())
    return list(torch.load(path, mmap=True, weights_only=True, map_location="cpu"))


def _first_rows(path: Path, key: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return f.get_slice(key)[:_COMPARED_ROWS]
    return torch.load(path, mmap=True, weights_only=True, map_location="cpu")[key][:_COMPARED_ROWS].clone()


def require_model(name: str | None) -> str:
    """The one 'no model given' check, for every entry (train, probe, plan, load_model)."""
    if not name:
        raise ConfigError("no model given: pass --model NAME_OR_PATH (a hub id, a local dir, or a shipped name "
                          "with --from-scratch) or --recipe NAME")
    return name


def load_model(name: str, *, from_scratch: bool, seed: int = 0, config: PretrainedConfig | None = None,
               tokenizer: Any = None, device: str | None = None, dtype: torch.dtype | None = None) -> LoadedModel:
    """Weights and tokenizer: pretrained from a hub id / local dir, or built from a config. `config` and
    `tokenizer`: what the caller already loaded (else loaded here). `device`, `dtype`: where and in what a
    from-scratch model is built and initialised (default the CPU, fp32); a pretrained one loads on the CPU.
    `notes` says what the checkpoint lacked (an LM head that starts random) or held beyond the model (a
    vision tower left out)."""
    require_model(name)
    if config is None:
        config = load_config(name, from_scratch=from_scratch)
    if tokenizer is None:  # before the weights: a missing tokenizer costs no load
        tokenizer = load_tokenizer(name, config, from_scratch=from_scratch)
    notes: list[str] = []
    if from_scratch:
        torch.manual_seed(seed)  # every device's generator
        model = build_model(config, device=device, dtype=dtype)
    else:
        model, notes = _from_pretrained(name, config)
    return LoadedModel(model=model, tokenizer=tokenizer, task=task_of(config), config=config, notes=notes)


def _from_pretrained(name: str, config: PretrainedConfig) -> tuple[PreTrainedModel, list[str]]:
    auto = AutoModelForSeq2SeqLM if task_of(config) == SEQ2SEQ else AutoModelForCausalLM
    keys = _TEXT_PART_KEYS.get(config.model_type)  # harmless on a text-only checkpoint: no name matches
    try:
        model, info = auto.from_pretrained(name, config=config, output_loading_info=True, key_mapping=keys,
                                           **hub_options(name))
    except (OSError, ValueError) as exc:
        if not Path(name, "config.json").is_file():
            raise ModelError(_not_found(name) + f" ({exc.__class__.__name__})") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ModelError(f"cannot load the weights in {name} ({first}): save the model there with "
                         "model.save_pretrained(DIR)") from exc
    notes = []
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        notes.append(f"{len(missing)} weights of {type(model).__name__} are not in {name} and start from random "
                     f"values: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
    if info["unexpected_keys"]:
        parts = sorted({k.split(".")[0] for k in info["unexpected_keys"]})
        notes.append(f"{len(info['unexpected_keys'])} tensors of {name} are not part of {type(model).__name__} and "
                     f"are left out of the run and of final/ ({', '.join(parts)})")
    return model, notes


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "sentencepiece.bpe.model")


def load_tokenizer(name: str, config: PretrainedConfig, *, from_scratch: bool):
    """The model's own tokenizer. The ByT5 byte tokenizer (it needs no files) only for an architecture built
    --from-scratch without tokenizer files of its own: pretrained weights trained on another tokenizer's ids
    would learn from the wrong tokens, so a user's model without a readable tokenizer is refused."""
    local = Path(name).is_dir()
    has_files = local and any((Path(name) / f).exists() for f in TOKENIZER_FILES)
    fix = (f"save the model's tokenizer there with tokenizer.save_pretrained({name!r})" if local else
           "give a local directory holding the model and its tokenizer (save_pretrained)")
    fix += " (or train with --from-scratch: random weights and a byte tokenizer)"
    if from_scratch and not has_files:
        tok = ByT5Tokenizer()
    elif local and not has_files:
        raise ModelError(f"{name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): {fix}")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(name, **hub_options(name))
        except (OSError, ValueError) as exc:  # a truncated tokenizer.json is a JSONDecodeError, a ValueError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelError(f"cannot read the tokenizer of {name} ({exc.__class__.__name__}: {first[:160]}): "
                             f"{fix}") from exc
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
