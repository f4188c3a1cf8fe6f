"""Inner learning-rate schedule: linear warm-up, then cosine decay over training progress."""

from __future__ import annotations

import math


def inner_lr(step: int, progress: float, peak: float, floor: float, warmup_steps: int) -> float:
    """Learning rate for inner step ``step`` (0-based) at ``progress`` ∈ [0, 1] of the token budget.

    Decay follows tokens rather than steps because adaptive batching makes the step count unknown in
    advance; with a fixed batch the two coincide.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
