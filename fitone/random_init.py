"""A model of any architecture with seeded random weights, made straight on its device.

For what does not depend on the weights' values (a probe's memory and speed): a CPU init of billions of
weights takes minutes, and a GPU model built on the CPU first would not fit in host RAM twice.
"""

from __future__ import annotations

import torch

from fitone.models import build_model


def build_random_model(config, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The architecture of `config` with seeded random weights, made on `device` in `dtype`.

    Built on the meta device, then each parameter (tied ones once) is allocated where DeepSpeed will
    keep it and filled there: N(0, initializer_range) for matrices, 1 for norm weights, 0 for biases.
    """
    model = build_model(config, meta=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    made: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    data = torch.empty(param.shape, dtype=dtype, device=device)
                    if data.dim() >= 2:
                        data.normal_(0.0, std, generator=generator)
                    else:
                        data.fill_(0.0 if name == "bias" else 1.0)
                    made[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    return model.to(device)  # buffers (init_empty_weights leaves them real, on the CPU)
