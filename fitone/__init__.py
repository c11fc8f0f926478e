"""fitone: fine-tune models too big for one GPU on one GPU (DeepSpeed ZeRO-2 + CPU offload).

In a notebook: `fitone.train(...)`, `fitone.probe_batch(...)`, `fitone.plan(...)` take the same options
as the CLI (TrainConfig fields) and return result objects.

The public API loads on first use (PEP 562): `import fitone` and the CLI's parsing and refusals do not
import torch, DeepSpeed or transformers, which take seconds of CPU.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from fitone import _jupyter  # noqa: F401 - first: imports tqdm.auto without its ipywidgets warning

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "TrainConfig": "fitone.config",
    "FitoneError": "fitone.errors",
    "Plan": "fitone.plan",
    "plan": "fitone.plan",
    "ProbeResult": "fitone.probe.results",
    "probe_batch": "fitone.probe.api",
    "load_recipe": "fitone.recipes",
    "TrainResult": "fitone.train",
    "train": "fitone.train",
}

__all__ = ["TrainConfig", "TrainResult", "ProbeResult", "Plan", "plan", "FitoneError", "load_recipe", "train",
           "probe_batch", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'fitone' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


class _Package(types.ModuleType):
    """Keeps `fitone.train` and `fitone.plan` the functions: the import system binds a submodule to its
    package's attribute when it first loads it (`from fitone.train import Trainer` would make
    `fitone.train` the module). The module stays in sys.modules, where imports find it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
