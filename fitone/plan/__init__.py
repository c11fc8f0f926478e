"""Predict GPU and host memory of a ZeRO-2 run (with or without CPU offload) before allocating anything.

The model is built on the meta device (shapes, no weights). Model states follow what DeepSpeed 0.19
allocates; activations follow what autograd saves, counted tensor by tensor for T5, GPT-2 and
Llama-style models; tests/plan/test_plan.py checks them against the measured t5-3b runs that bench/README.md lists.

`plan()` answers "will it fit, and how big a micro-batch"; `preflight()` is the check (host RAM, and the
GPU at micro-batch 1) that `fitone train` and `fitone probe-batch` run from the config before allocating.

The arithmetic lives in parts: `shape` (the model's sizes), `activations` (bytes per sample),
`components` (what each piece holds, and the Plan), `advice` (verdict and suggestions) and `estimate`
(`plan()`, `preflight()`). Names with a leading underscore are private to this package.
"""

from fitone.plan.activations import Lengths, activation_bytes
from fitone.plan.advice import DOES_NOT_FIT, FITS_ON_GPU, FITS_WITH_OFFLOAD, PHASE_FIXES, unforeseen_oom
from fitone.plan.result import CATEGORIES, Component, Plan
from fitone.plan.estimate import host_micro_batch_bound, plan, preflight
from fitone.plan.shape import ModelShape, model_shape

__all__ = ["plan", "preflight", "host_micro_batch_bound", "unforeseen_oom", "PHASE_FIXES", "Plan", "Component",
           "CATEGORIES", "FITS_ON_GPU", "FITS_WITH_OFFLOAD", "DOES_NOT_FIT", "ModelShape", "model_shape", "Lengths",
           "activation_bytes"]
