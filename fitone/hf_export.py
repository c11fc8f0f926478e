"""RUN_DIR/final/: the trained model as a plain Hugging Face model dir, written one shard at a time.

The streamed write repeats what `save_pretrained` does through transformers' own internals
(`revert_weight_conversion`, `remove_tied_weights_from_state_dict`, the shard naming), read from the
transformers versions in TESTED_TRANSFORMERS. Under any other version final/ is written by `save_pretrained`
itself, from one host copy of the weights, and one warning line names the fix: a changed internal must not
write a model that loads differently.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors.torch import save_file

from fitone.runtime import no_hf_progress_bars

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# (major, minor) of the first and last transformers the streamed write was checked on: the GPU machine's 5.17.0
# (bench/results/2026-12-01-issue27/llama-3.1-8b/, an 8B export loaded back) and the CPU suite's 5.25.0 (5.25
# left save_pretrained, remove_tied_weights_from_state_dict and revert_weight_conversion as 5.24 had them)
TESTED_TRANSFORMERS = ((5, 17), (5, 25))


def untested_transformers(version: str | None = None) -> str | None:
    """The warning for a transformers (installed, or `version`) outside TESTED_TRANSFORMERS; None inside it."""
    if version is None:
        import transformers

        version = transformers.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = TESTED_TRANSFORMERS
    if found and low <= (int(found[1]), int(found[2])) <= high:
        return None
    return (f"warning: fitone's streamed export follows transformers {low[0]}.{low[1]}-{high[0]}.{high[1]} but "
            f"transformers {version} is installed, so final/ is written by save_pretrained from a whole host copy "
            f"of the weights (more host RAM than `fitone plan` counts): pip install "
            f"'transformers>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}' for the streamed export")


# The export writes one shard at a time: each is copied to the host, written, and dropped before the next
# (the whole model copied at once adds its 16-bit size to training's host peak: bench/results/2026-12-01-issue19/).
EXPORT_SHARD_SIZE = "2GB"


def export(model: PreTrainedModel, tokenizer: Any, run_dir: str | Path, *,
           shard_size: int | str = EXPORT_SHARD_SIZE, say: Callable[[str], None] = print) -> Path:
    """RUN_DIR/final/: a plain Hugging Face model dir (weights + tokenizer), loadable without DeepSpeed.

    ZeRO-2 keeps full 16-bit weights on every rank, so the caller's rank saves them as they are (as HF
    Trainer does with ZeRO-2). The files are those `save_pretrained(max_shard_size=shard_size)` writes,
    streamed (`_write_weights`) where that is proven to match; `say` gets the warning of an untested
    transformers (untested_transformers). Written to a temporary dir first, then renamed.
    """
    run_dir = Path(run_dir)
    final, tmp = run_dir / "final", run_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.use_cache = True
    warning = untested_transformers()
    if warning is not None:
        say(warning)
    with no_hf_progress_bars():
        if warning is None and _streams(model):
            tmp.mkdir(parents=True)
            # what save_pretrained records in the config before saving it
            model.config.dtype = str(model.dtype).split(".")[1]
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(tmp)
            if model.can_generate():
                model.generation_config.save_pretrained(tmp)
            _write_weights(model, tmp, shard_size)
        else:  # the whole model on the host at once, but still nothing cloned on its device
            model.save_pretrained(tmp, state_dict=host_state_dict(model), max_shard_size=shard_size)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def _streams(model: PreTrainedModel) -> bool:
    """Whether `_write_weights` writes what save_pretrained would. It skips what transformers does for PEFT
    adapters, quantized, remote-code, device-mapped or tensor-parallel models and for models whose weights
    are renamed or reshaped on save (revert_weight_conversion): those go through save_pretrained instead."""
    try:  # transformers' internals the streamed write follows (5.x); without them, its plain save_pretrained
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: F401
    except ImportError:
        return False
    if (getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None
            or model.is_remote_code() or getattr(model, "hf_device_map", None) or getattr(model, "_tp_size", None)):
        return False
    probe = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}
    try:
        reverted = revert_weight_conversion(model, probe)
    except Exception:  # a conversion that cannot run on meta tensors is a conversion all the same
        return False
    # nothing renamed or reshaped: a from_pretrained model with no conversions gets an empty list, which skips the
    # quick exit (`is probe`) yet hands back every tensor as it is under its own name
    return reverted.keys() == probe.keys() and all(reverted[name] is t for name, t in probe.items())


def _write_weights(model: PreTrainedModel, out: Path, shard_size: int | str) -> None:
    """The model's safetensors files (and index when sharded) as save_pretrained writes them, holding at most
    one shard on the host and cloning nothing on the weights' device."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    state = model.state_dict()
    for name in model._keys_to_ignore_on_save or ():
        state.pop(name, None)
    # transformers decides which tied names to keep by storage; it sees one-element host stand-ins (the same
    # one for names that are one tensor, as host_state_dict groups them), so it resolves ties on those and
    # clones nothing real (it clones tensors that share a buffer without overlapping: all of ZeRO-2's)
    stand_ins: dict[tuple[Any, ...], torch.Tensor] = {}
    proxies = {}
    for name, t in state.items():
        proxies[name] = stand_ins.setdefault(_tensor_key(name, t), torch.empty(1))
    kept = remove_tied_weights_from_state_dict(proxies, model).keys()
    # sizes without storages: meta tensors shaped like the kept weights
    meta = {name: torch.empty(state[name].shape, dtype=state[name].dtype, device="meta") for name in kept}
    # save_pretrained reverts the load-time conversions next: `_streams` found they rename and reshape nothing, but
    # for a from_pretrained model the revert still sorts the names, and the shards follow that order
    meta = revert_weight_conversion(model, meta)
    split = split_torch_state_dict_into_shards(meta, filename_pattern=SAFE_WEIGHTS_NAME.replace(
        ".safetensors", "{suffix}.safetensors"), max_shard_size=shard_size)
    for filename, names in split.filename_to_tensors.items():
        _write_shard(state, names, out / filename)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_shard(state: dict[str, torch.Tensor], names: list[str], path: Path) -> None:
    """One shard copied to the host and written; its host copies die when this returns."""
    shard = {name: state[name].detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
             for name in names}
    save_file(shard, str(path), metadata={"format": "pt"})


def host_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights copied to the host, one copy per distinct tensor (tied weights stay tied).

    DeepSpeed keeps every weight inside flat buffers; save_pretrained clones tensors that share a buffer on
    their own device, a second copy of the weights that a full GPU cannot hold (llama-7b under a 23 GiB
    cap ran out of memory there: bench/results/2026-12-01-issue19/).
    """
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = _tensor_key(name, tensor)
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out


def _tensor_key(name: str, tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for the names of one tensor (tied weights); an empty tensor is its own (its data_ptr is 0)."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)) if tensor.numel() else (name,)
