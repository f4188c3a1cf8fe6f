"""The time-aware batch controller: the batch that reaches a loss soonest on this hardware and link.

Progress model (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): reaching a given loss
takes S ≈ S_min·(1 + B_noise/B) steps at a global batch B, with the noise scale B_noise ≈ B_simple =
tr Σ / ‖∇F‖² from the scalar statistics the batch tests already gather. Cost model: one inner step of a worker
costs t(b) = overhead + per_sample·b seconds (timed at start-up, rescaled by what the real steps take), and a
round adds T_round seconds of exchange and waiting, shared by its H steps. The controller picks the per-worker
b minimising (1 + B_noise/(M·b))·(t(b) + T_round/H), then moves towards it at most 2x per decision and only
after the same direction held for ``patience`` decisions in a row (Merrill et al. 2025 grow OLMo's batch that
way), within [b_min, min(b_cap, what the remaining budget allows)].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepCost:
    """Seconds one inner step of one worker takes at per-worker batch b: ``overhead + per_sample·b``."""

    overhead: float
    per_sample: float

    def at(self, b: float) -> float:
        return self.overhead + self.per_sample * b

    def scaled(self, factor: float) -> StepCost:
        return StepCost(self.overhead * factor, self.per_sample * factor)


def fit_step_cost(points: Sequence[tuple[int, float]]) -> StepCost:
    """The least-squares line through timed (b, seconds) points, kept non-negative in both terms."""
    if not points:
        raise ValueError("fit_step_cost needs at least one timed step")
    if len({b for b, _ in points}) == 1:
        b, seconds = points[0]
        return StepCost(0.0, max(seconds, 0.0) / b)
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    slope = max(slope, 0.0)
    overhead = mean_t - slope * mean_b
    if overhead < 0.0:  # all of the time grows with b: a line through the origin
        slope, overhead = sum(b * t for b, t in points) / sum(b * b for b, _ in points), 0.0
    return StepCost(overhead, slope)


def noise_scale(sample_variance: float, grad_norm_sq: float) -> float:
    """B_simple = tr Σ / ‖∇F‖² (inf when the gradient estimate is noise only)."""
    if grad_norm_sq <= 0.0 or not math.isfinite(grad_norm_sq):
        return math.inf
    return max(sample_variance, 0.0) / grad_norm_sq


def resolvable_noise_scale(sample_variance: float, grad_norm_sq: float, samples: float) -> float:
    """B_simple = tr Σ / ‖∇F‖², at most ``samples``, the samples the statistics were measured on.

    An estimate of ‖∇F‖² from n samples is uncertain by about σ²/n, so a noise scale beyond n cannot be told from
    a larger one, and a non-positive estimate says only that the gradient was lost in the noise. Such a noise
    scale reads as n, not as infinite: read as infinite (or as σ² over a tiny positive estimate), one noisy round
    aimed b at its ceiling. With the noise scale at n, b grows only while the step's fixed cost and the round's
    exchange make a larger batch cheaper per unit of progress.
    """
    return min(noise_scale(sample_variance, grad_norm_sq), float(samples))


PerStep = Callable[[float], float]  # seconds per step, its round's share included, at a step time t


def seconds_per_progress(
    b: int, workers: int, noise: float, cost: StepCost, round_seconds: float, h: int, per_step: PerStep | None = None
) -> float:
    """Predicted time per unit of progress at per-worker batch b (up to the constant S_min); ``per_step``: the
    step's seconds with its share of the round when H follows the step time (``sync_every=auto``)."""
    t = cost.at(b)
    return (1.0 + noise / (workers * b)) * (t + round_seconds / h if per_step is None else per_step(t))


def fastest_batch(
    noise: float,
    workers: int,
    cost: StepCost,
    round_seconds: float,
    h: int,
    b_min: int,
    b_max: int,
    per_step: PerStep | None = None,
) -> int:
    """The per-worker b in [b_min, b_max] with the least predicted time per unit of progress."""
    if math.isinf(noise):
        return b_max
    return min(
        range(b_min, b_max + 1),
        key=lambda b: seconds_per_progress(b, workers, noise, cost, round_seconds, h, per_step),
    )


@dataclass(frozen=True)
class TimedDecision:
    """A time-aware decision: the b to use, the b it aims at, and what it was computed from."""

    b_req: int
    target: int
    noise_scale: float
    step_seconds: float
    round_seconds: float
    limit: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TimeAwareController:
    """Moves a trainer's b towards the fastest batch: at most ``max_growth``x per decision, after ``patience``
    decisions in a row pointed the same way; down only with ``allow_shrink``."""

    def __init__(
        self, *, b_min: int, b_cap: int, patience: int = 2, max_growth: float = 2.0, allow_shrink: bool = False
    ) -> None:
        if not 1 <= b_min <= b_cap or patience < 1 or max_growth <= 1.0:
            raise ValueError(f"need 1 <= b_min <= b_cap, patience >= 1, max_growth > 1 ({b_min}, {b_cap})")
        self.b_min, self.b_cap = b_min, b_cap
        self.patience, self.max_growth, self.allow_shrink = patience, max_growth, allow_shrink
        self.streak = 0  # decisions in a row that pointed up (> 0) or down (< 0)

    def decide(
        self,
        noise: float,
        workers: int,
        current_b: int,
        cost: StepCost,
        round_seconds: float,
        h: int,
        limit: int | None = None,
        per_step: PerStep | None = None,
    ) -> TimedDecision:
        ceiling = max(self.b_min, min(self.b_cap, self.b_cap if limit is None else limit))
        target = fastest_batch(noise, workers, cost, round_seconds, h, self.b_min, ceiling, per_step)
        direction = 1 if target > current_b else -1 if target < current_b and self.allow_shrink else 0
        same_way = direction != 0 and self.streak * direction > 0
        self.streak = self.streak + direction if same_way else direction
        b = current_b
        if direction > 0 and self.streak >= self.patience:
            b = max(current_b, min(target, math.floor(current_b * self.max_growth)))
        elif direction < 0 and -self.streak >= self.patience:
            b = max(target, math.ceil(current_b / self.max_growth))
        if b != current_b:
            self.streak = 0
        return TimedDecision(b, target, noise, cost.at(b), round_seconds, ceiling)

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state["streak"])
