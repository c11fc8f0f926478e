"""fitone: fine-tune models too big for one GPU on one GPU (DeepSpeed ZeRO-2 + CPU offload).

In a notebook: `fitone.train(...)`, `fitone.probe_batch(...)`, `fitone.plan(...)` take the same options
as the CLI (TrainConfig fields) and return result objects.
"""

from fitone import _jupyter  # noqa: F401 - first: imports tqdm.auto without its ipywidgets warning
from fitone.config import TrainConfig
from fitone.errors import FitoneError
from fitone.plan import Plan, plan
from fitone.probe import ProbeResult
from fitone.probe_run import probe_batch
from fitone.recipes import load_recipe
from fitone.train import TrainResult, train

__version__ = "0.1.0"

__all__ = ["TrainConfig", "TrainResult", "ProbeResult", "Plan", "plan", "FitoneError", "load_recipe", "train",
           "probe_batch", "__version__"]
