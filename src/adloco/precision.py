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


def configure_matmuls(device: torch.device, tf32: bool) -> None:
    """On CUDA, whether float32 matmuls and convolutions may run on TF32 tensor cores (products with a 10-bit
    mantissa, float32 accumulation); CPU matmuls are left alone."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """How a worker's AdamW runs on ``device``: fused on CUDA (one kernel for all tensors); on CPU the
    single-tensor loop, whose element-wise operations a worker group's stacked update repeats exactly."""
    return {"fused": True} if device.type == "cuda" else {"foreach": False}
