"""Mixed precision for the inner steps: the forward pass runs under autocast, everything else in float32.

Parameters (the master weights), gradients, AdamW state, the outer state and every exchange stay float32;
only the activations and matmuls of a training step's forward (and so of its backward) use the lower
precision. Evaluation runs in float32, so validation losses compare across precisions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
Step = TypeVar("Step")

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolved_precision(precision: str, device: torch.device) -> str:
    """``precision=auto`` on ``device``: bf16 on a CUDA GPU that has it (the fast path there), fp32 elsewhere."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager:
    """The context a training step's forward runs in: nothing for fp32, autocast to the dtype otherwise."""
    dtype = AUTOCAST_DTYPES[resolved_precision(precision, device)]
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


@dataclass
class LossScale:
    """A worker's dynamic loss scale for fp16 steps (fixed at 1 in fp32 and bf16, whose range needs none).

    The backward runs on the loss times ``scale`` so that small activation gradients do not flush to zero in
    float16; the gradients are divided by it again before anything reads them. Where they overflowed, the worker
    halves the scale and computes the same step again on the same samples: unlike skipping the update, as
    ``torch.amp.GradScaler`` does, every worker then takes the same number of inner steps on the same tokens, which
    keeps the round's budget, the workers' step counts and the data order.
    After ``GROWTH_INTERVAL`` steps in a row without an overflow the scale doubles. Scales are powers of two, so
    scaling and unscaling change no bit of a gradient that neither overflows nor underflows.
    """

    INITIAL = 2.0**16
    FLOOR = 1.0
    CEILING = 2.0**24
    GROWTH_INTERVAL = 2000

    enabled: bool = False
    scale: float = 1.0
    good_steps: int = 0  # steps in a row since the scale last changed or overflowed

    @classmethod
    def for_precision(cls, precision: str) -> LossScale:
        """The scale a new worker starts with: dynamic from 2^16 for fp16, a constant 1 otherwise."""
        return cls(enabled=True, scale=cls.INITIAL) if precision == "fp16" else cls()

    def back_off(self) -> bool:
        """After a step whose gradients overflowed: halve the scale for a retry. False, with nothing changed, where
        the scale is at its floor already, so the overflow is not the scale's doing."""
        if not self.enabled or self.scale <= self.FLOOR:
            return False
        self.scale /= 2
        self.good_steps = 0
        return True

    def settle(self, finite: bool, scale_before: float) -> None:
        """Close a step: count a finite one (growing the scale after enough); after a non-finite one that no
        smaller scale cured, go back to the scale the step began with."""
        if not self.enabled:
            return
        if not finite:
            self.scale = scale_before
            return
        self.good_steps += 1
        if self.good_steps >= self.GROWTH_INTERVAL and self.scale < self.CEILING:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        scale, good_steps = float(state["scale"]), int(state["good_steps"])
        if not self.FLOOR <= scale <= self.CEILING or good_steps < 0:  # NaN fails too
            raise ValueError(f"loss scale {scale!r} with {good_steps} good steps is out of range")
        self.scale, self.good_steps = scale, good_steps


def until_no_overflow(
    step: Callable[[], Step],
    outcome: Callable[[Step], Sequence[tuple[bool, float]]],
    scales: Sequence[LossScale],
    who: str,
) -> Step:
    """``step()``, computed again on the same samples while a worker's fp16 gradients overflowed (its loss finite,
    its gradients not) and its loss scale can still halve; ``outcome`` says each worker's (finite, loss) in the
    order of ``scales``. One rule for a single worker and a stacked group: each worker's gradient depends on its
    own scale only, so the others' retried gradients come out the same."""
    while True:
        result = step()
        overflowed = [
            scale.back_off()
            for scale, (finite, loss) in zip(scales, outcome(result), strict=True)
            if not finite and math.isfinite(loss)
        ]
        if not any(overflowed):
            return result
        log.debug("%s: fp16 gradients overflowed; retrying with scales %s", who, [s.scale for s in scales])


# Dense peaks (FLOP/s, no sparsity) of GPUs by a substring of their name, per compute dtype: bf16/fp16 tensor cores,
# tf32 (float32 matmuls on tensor cores) and plain fp32. The first match wins, so a variant precedes its family.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("RTX 4090", {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
)


def compute_dtype(precision: str, tf32: bool) -> str:
    """What the inner step's matrix products run in: bf16, fp16, tf32 or fp32."""
    if precision != "fp32":
        return precision
    return "tf32" if tf32 else "fp32"


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """The device's dense peak for the run's compute dtype, where it is in the table (CUDA GPUs); None elsewhere
    (a CPU's depends on its cores, clock and vector units: give run.peak_tflops)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = compute_dtype(resolved_precision(precision, device), tf32)
    for part, peaks in _PEAKS:
        if part in name:
            return peaks.get(dtype)
    return None
