"""Mixed precision for the inner steps: the forward pass runs under autocast, everything else in float32.

Parameters (the master weights), gradients, AdamW state, the outer state and every exchange stay float32;
only the activations and matmuls of a training step's forward (and so of its backward) use the lower
precision. Evaluation runs in float32, so validation losses compare across precisions.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager:
    """The context a training step's forward runs in: nothing for fp32, autocast to the dtype otherwise."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
