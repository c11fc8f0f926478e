"""Built-in recipes: `recipes/<model>/<gpu-class>.yaml`, flat keys that are train options.

Found by globbing the folder (no hand-kept registry). In a source checkout that is the repo's
`recipes/`; an installed fitone carries the same files as package data.
"""

from __future__ import annotations

import difflib
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fitone import notice
from fitone.config import TrainConfig, check_keys
from fitone.errors import ConfigError

if TYPE_CHECKING:
    from fitone.probe.results import ProbeResult


def recipe_dir() -> Path:
    """The repo's `recipes/` in a source checkout (edits show at once), else the installed copy."""
    root = Path(__file__).resolve().parent.parent
    # pyproject.toml tells a checkout from site-packages, which may hold some other package's `recipes/`
    if (root / "recipes").is_dir() and (root / "pyproject.toml").is_file():
        return root / "recipes"
    from importlib.resources import files

    return Path(str(files("fitone") / "_recipes"))


@dataclass
class Recipe:
    name: str  # "<model>/<gpu-class>"
    path: Path
    values: dict[str, Any]
    header: str  # the leading comment block: the command that runs it, and what was measured

    @property
    def model(self) -> str:
        return str(self.values.get("model", "?"))

    @property
    def gpu_class(self) -> str:
        return self.path.stem  # "24gb", "80gb", "cpu"

    @property
    def batch(self) -> str:
        """What the file runs: '256 x 1' (micro-batch x accumulation), or 'auto' (probed at the start)."""
        cfg = self.config()
        if cfg.batch_size == "auto":
            return "auto" + (f", global {cfg.global_batch}" if cfg.global_batch else "")
        try:
            return f"{cfg.batch_size} x {cfg.accumulation(cfg.batch_size)}"
        except ConfigError:  # the list still shows it; training it says how to fix it
            return f"{cfg.batch_size}, global {cfg.global_batch}: not a multiple"

    @property
    def measured(self) -> str | None:
        """What the header says was measured, with the micro-batch it ran at (which need not be the file's):
        'probed: batch_size 30 on GPU' from a `# probe-batch:` line (`fitone probe-batch --save` wrote it, and
        the batch size with it), else 'at micro-batch 323 (batch_size=auto), 86.3 samples/s' from the header's
        `# Measured:` line (copied from bench/results/); None when neither holds numbers."""
        probed = self._header_line("probe-batch:")
        size = re.search(r"batch_size (\d+)", probed)
        if size:
            where = re.search(r" on (.+)$", probed)
            return f"probed: batch_size {size.group(1)}" + (f" on {where.group(1)}" if where else "")
        measured = self._header_line("measured:")
        batch = re.search(r"micro-batch (\d+)( x \d+)?", measured)
        speed = re.search(r"([\d.]+) samples/s", measured)
        if batch and speed:
            auto = " (batch_size=auto)" if "batch_size=auto" in measured else ""
            return f"at micro-batch {batch.group(1)}{batch.group(2) or ''}{auto}, {speed.group(1)} samples/s"
        return None

    def _header_line(self, label: str) -> str:
        """The header line starting with `label`, joined with its indented continuation lines."""
        lines = self.header.splitlines()
        for i, line in enumerate(lines):
            if line.lstrip("# ").lower().startswith(label):
                more = []
                for follow in lines[i + 1:]:
                    if not follow.startswith("#   ") or follow.startswith("#   fitone "):
                        break
                    more.append(follow[4:])
                return " ".join([line, *more])
        return ""

    def config(self, **overrides: Any) -> TrainConfig:
        """The recipe's values with `overrides` on top (a key=value or a flag beats the file). The recipe's
        gpu_adam_share is tuned for its own step: overrides that take another (--optimizer-states bf16,
        --no-pipelined-update, --delayed-update, --offload none) train without it, and one line says so."""
        given = {k.replace("-", "_"): v for k, v in overrides.items()}  # as from_dict reads them
        values = {**self.values, **given, "recipe": self.name}
        if "gpu_adam_share" in given or not values.get("gpu_adam_share"):
            return TrainConfig.from_dict(values, where=f"recipe {self.name}")
        share = values.pop("gpu_adam_share")
        cfg = TrainConfig.from_dict(values, where=f"recipe {self.name}")
        if cfg.takes_gpu_adam_share():
            return cfg.replace(gpu_adam_share=share)
        notice.say(f"recipe {self.name}'s gpu_adam_share {share} shares the fp32 pipelined update's CPU Adam, "
                   "which these options do not run: training without it")
        return cfg


def list_recipes() -> list[Recipe]:
    return [_read(p) for p in sorted(recipe_dir().glob("*/*.yaml"))]


def recipe_names() -> list[str]:
    return [f"{p.parent.name}/{p.stem}" for p in sorted(recipe_dir().glob("*/*.yaml"))]


def load_recipe(name: str) -> Recipe:
    """A recipe by name ('t5-3b/24gb') or by path to a YAML file (a copied and edited one)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return _read(path, name=str(path))
    candidate = recipe_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if candidate.is_file():
        return _read(candidate)
    names = recipe_names()
    if path.suffix in (".yaml", ".yml") and name.removesuffix(".yaml") not in names:
        raise ConfigError(f"recipe file {name} does not exist: give a YAML path, or a built-in name "
                          f"(`fitone recipes` lists them)")
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"available: {', '.join(names)}"
    raise ConfigError(f"no recipe named {name!r}: {hint} (`fitone recipes` lists them)")


def _read(path: Path, name: str | None = None) -> Recipe:
    text = path.read_text()
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML ({exc}); fix the file") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"recipe {path} must be a mapping of train options (key: value)")
    name = name or f"{path.parent.name}/{path.stem}"
    check_keys(values, TrainConfig.field_names(), f"recipe {name}")
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    return Recipe(name=name, path=path, values=_numbers(values), header=header)


def copy_recipe(name: str, dest: str | Path) -> Path:
    """Copy a recipe out to edit (then `fitone train --recipe FILE`); never overwrites."""
    recipe = load_recipe(name)
    dest = Path(dest)
    if dest.is_dir():
        dest = dest / f"{recipe.path.parent.name}-{recipe.path.name}"
    if dest.exists():
        raise ConfigError(f"{dest} already exists: choose another destination (copy never overwrites)")
    if not dest.parent.is_dir():
        raise ConfigError(f"no directory {dest.parent} to copy into: create it or choose another destination")
    shutil.copyfile(recipe.path, dest)
    return dest


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """key=value pairs from the command line; values parsed as YAML scalars (8 -> int, true -> bool)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"cannot read override {pair!r}: write key=value, e.g. batch_size=16")
        key, _, raw = pair.partition("=")
        try:
            out[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            out[key.strip().replace("-", "_")] = raw
    return _numbers(out)


# What YAML 1.1 (PyYAML) leaves as a string although a user means a number: 1e-4, 3E+5, 2.5e3.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _numbers(values: dict[str, Any]) -> dict[str, Any]:
    """Read `lr: 1e-4` as 0.0001 (not the string '1e-4') for the TrainConfig fields that hold numbers."""
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    out = {}
    for key, value in values.items():
        kind = kinds.get(key.replace("-", "_"), "")
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            number = float(value)
            if kind.startswith("float"):
                value = number
            elif kind.startswith("int") and number.is_integer():
                value = int(number)
        out[key] = value
    return out


def save_to_recipe(result: ProbeResult, recipe_path: str | Path) -> Path:
    """Write `batch_size: N` (the probe's micro-batch to train with) into a recipe YAML, in place, keeping its
    comments; say what was measured.

    The value of a top-level `batch_size:` line is replaced (its inline comment kept) or the line is added;
    so is `global_batch:` where the choice was made for one the file does not hold (the user's --global-batch
    is kept: every candidate divides it), or `grad_accum:` for a fixed accumulation the file lacks. A
    `# probe-batch: ...` line at the end of the header comment records the measurement. A file that does not
    exist yet becomes a recipe of the probed settings.
    """
    path = Path(recipe_path)
    micro = result.micro_batch if result.micro_batch is not None else result.chosen
    note = f"# probe-batch: {_measured(result, micro)}"
    if path.exists():
        lines = path.read_text().splitlines()
    else:
        lines = [f"{k}: {_yaml_scalar(v)}" for k, v in _recipe_values(result.meta).items()]
    lines = [line for line in lines if not line.startswith("# probe-batch:")]
    wanted: dict[str, int] = {"batch_size": micro}
    if result.global_batch is not None:
        wanted["global_batch"] = result.global_batch
    elif (result.accumulation or 1) > 1:
        wanted["grad_accum"] = result.accumulation
    for key, value in wanted.items():
        _set_line(lines, key, value)
    header_end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    lines.insert(header_end, note)
    text = "\n".join(lines) + "\n"
    by_hand = ", ".join(f"`{k}: {v}`" for k, v in wanted.items())
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--save {path}: cannot update this YAML ({exc}); add {by_hand} by hand") from exc
    if not isinstance(values, dict) or any(values.get(k) != v for k, v in wanted.items()):
        raise ConfigError(f"--save {path}: not a flat recipe with one `batch_size:` line; add {by_hand} by hand")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def _set_line(lines: list[str], key: str, value: int) -> None:
    """Replace the value of a top-level `key:` line (keeping its inline comment), or add the line."""
    for i, line in enumerate(lines):
        m = re.match(rf"{key}\s*:\s*[^#]*?(\s+#.*)?$", line)
        if m:
            lines[i] = f"{key}: {value}{m.group(1) or ''}"
            return
    lines.append(f"{key}: {value}")


def _measured(result: ProbeResult, micro: int) -> str:
    m = result.meta
    lengths = f"seq {m['seq_len']}" if "seq_len" in m else f"src/tgt {m.get('src_len')}/{m.get('tgt_len')}"
    cap = f", cap {m['max_gpu_memory']}" if m.get("max_gpu_memory") else ""
    check = "verified" if result.verified else "not verified"
    timed = [t for t in result.candidates() if (t.batch_size, t.accumulation) == (micro, result.accumulation)]
    why = (f"batch_size {micro} x {result.accumulation} accumulation, the most samples/s timed"
           + (f" ({timed[0].samples_per_s:.1f})" if timed and timed[0].samples_per_s is not None else "")
           + f"; largest fit {result.largest_fit}" if result.prefer == "throughput"
           else f"batch_size {micro} = largest fit {result.largest_fit}")
    return (f"{why} less a {result.margin * 100:g}% "
            f"margin ({check}); {m.get('model')} {m.get('precision')}, {lengths}, "
            f"{'activation checkpointing' if m.get('activation_checkpointing') else 'no checkpointing'}, "
            f"on {m.get('gpu')}{cap} ({m.get('date', '')[:10]})")


def _recipe_values(meta: dict[str, Any]) -> dict[str, Any]:
    names = ("model", "from_scratch", "data", "pack", "src_len", "tgt_len", "seq_len", "precision",
             "activation_checkpointing", "offload", "max_gpu_memory", "device")
    values = {k: meta[k] for k in names if meta.get(k) is not None}
    # the optimizer step, only where the default would take another one (a saved probe serves both a
    # default run and an explicit --pipelined-update on a GPU: the recipe must not pin what was not asked)
    on_gpu = meta.get("device") == "cuda"
    if meta.get("update") == "pipelined" and not on_gpu:
        values["pipelined_update"] = True
    elif meta.get("update") == "deepspeed" and on_gpu and meta.get("offload") == "cpu":
        values["pipelined_update"] = False
    return values


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
