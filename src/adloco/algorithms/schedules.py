"""Schedules: the inner learning rate (linear warm-up, then cosine decay over training progress), its coupling
to a trainer's batch size, and the streaming fragments' sync steps. Plain integer and float math, so that
config validation needs no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def inner_lr(step: int, progress: float, peak: float, floor: float, warmup_steps: int) -> float:
    """Learning rate for inner step ``step`` (0-based) at ``progress`` ∈ [0, 1] of the token budget.

    Decay follows tokens rather than steps because adaptive batching makes the step count unknown in
    advance; with a fixed batch the two coincide. The cosine counts from token 0, so the first step after the
    warm-up is already at the cosine of the fraction the warm-up read (the lr steps down there).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class BatchCoupling:
    """The inner optimizer's settings as functions of a trainer's batch b against the batch it started with.

    lr × (b/b_start)^α, kept within [1/lr_cap, lr_cap]: a larger batch buys a larger step, not only a less
    noisy one (α = 0.5 follows Adam's square-root rule, Malladi et al. 2022; α = 1 is the linear rule of Goyal
    et al. 2017). β2' = β2^(b/b_start): AdamW's second moment then averages over the same number of samples
    rather than the same number of steps. Both are exactly the configured values at b = b_start.
    """

    b_start: int
    lr_exponent: float = 0.0
    lr_cap: float = 1.0
    scale_beta2: bool = False

    def lr_scale(self, b: int) -> float:
        if b == self.b_start or self.lr_exponent == 0.0:
            return 1.0
        return min(max((b / self.b_start) ** self.lr_exponent, 1.0 / self.lr_cap), self.lr_cap)

    def beta2(self, beta2: float, b: int) -> float:
        if b == self.b_start or not self.scale_beta2:
            return beta2
        return beta2 ** (b / self.b_start)


def validate_schedule(sync_every: int, fragments: int, overlap: int) -> None:
    """Streaming needs H divisible by P and an overlap τ shorter than the gap H/P between fragments."""
    if sync_every < 1 or fragments < 1:
        raise ValueError(f"sync_every ({sync_every}) and streaming.fragments ({fragments}) must be >= 1")
    if sync_every % fragments != 0:
        raise ValueError(f"sync_every ({sync_every}) must be a multiple of streaming.fragments ({fragments})")
    if not 0 <= overlap < sync_every // fragments:
        raise ValueError(
            f"streaming.overlap ({overlap}) must be >= 0 and < sync_every/fragments ({sync_every // fragments})"
        )


def fragment_offsets(sync_every: int, fragments: int) -> list[int]:
    """t_p = p·H/P."""
    return [p * sync_every // fragments for p in range(fragments)]


def fragments_sending_at(step: int, sync_every: int, fragments: int) -> list[int]:
    """Fragments that send at inner step ``step`` (1-based, counted from the start of training, or of the round:
    the schedule repeats every H).

    Fragment p sends at t_p, t_p + H, t_p + 2H, … (never at step 0), so fragment 0 syncs on the round
    boundaries H, 2H, … and with P = 1 the single fragment syncs exactly where DiLoCo does.
    """
    offsets = fragment_offsets(sync_every, fragments)
    return [p for p, t in enumerate(offsets) if step > 0 and step >= t and (step - t) % sync_every == 0]


def fragments_receiving_at(step: int, sync_every: int, fragments: int, overlap: int) -> list[int]:
    """Fragments whose exchange, started ``overlap`` steps earlier, is applied at ``step``."""
    return fragments_sending_at(step - overlap, sync_every, fragments) if step - overlap > 0 else []
