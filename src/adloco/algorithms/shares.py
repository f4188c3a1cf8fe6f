"""Workers of unequal speed in one trainer: each reads a share of the trainer's batch that makes its H inner
steps take about as long as everyone else's, and the pseudo-gradients are averaged with sample weights.

With a step cost t_w(b) = a_w + c_w·b per worker, the shares that make every step take the same time T solve
a_w + c_w·b_w = T with Σ b_w = B, so T = (B + Σ a_w/c_w) / Σ 1/c_w. A worker whose share would fall below one
sample reads one and the rest is shared among the others. Shares are whole samples summing to B exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from adloco.algorithms.controller import StepCost

_FASTEST = 1e-12  # seconds per sample standing in for a cost with no per-sample part


def _slope(cost: StepCost) -> float:
    return max(cost.per_sample, _FASTEST)


def _common_time(total: float, costs: Sequence[StepCost]) -> float:
    """T such that Σ (T − a_w)/c_w = total."""
    return (total + math.fsum(c.overhead / _slope(c) for c in costs)) / math.fsum(1.0 / _slope(c) for c in costs)


def balanced_split(total: int, costs: Sequence[StepCost]) -> list[int]:
    """Whole samples per worker, at least one each and summing to ``total``, that equalise the step times."""
    n = len(costs)
    if n == 0 or total < n:
        raise ValueError(f"cannot split {total} samples over {n} workers with at least one each")
    at_floor: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in at_floor]
        t = _common_time(total - len(at_floor), [costs[i] for i in free])
        ideal = {i: (t - costs[i].overhead) / _slope(costs[i]) for i in free}
        below = {i for i, x in ideal.items() if x < 1.0}
        if not below:
            break
        at_floor |= below
    exact = [1.0 if i in at_floor else ideal[i] for i in range(n)]
    shares = [max(1, math.floor(x)) for x in exact]
    # Hand the samples rounding left over to the largest remainders (ties to the lower worker).
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def balanced_cost(costs: Sequence[StepCost]) -> StepCost:
    """The trainer's step time at per-worker batch b when its M·b samples are split by ``balanced_split``."""
    inverse = math.fsum(1.0 / _slope(c) for c in costs)
    return StepCost(math.fsum(c.overhead / _slope(c) for c in costs) / inverse, len(costs) / inverse)


def sample_weights(samples: Sequence[int]) -> list[float]:
    """Each worker's samples over the mean: every weight is exactly 1.0 when the shares are equal, so the
    weighted mean of the pseudo-gradients is then the plain one, bit for bit."""
    if not samples or min(samples) < 1:
        raise ValueError(f"sample weights need positive counts, got {list(samples)}")
    if len(set(samples)) == 1:
        return [1.0] * len(samples)
    mean = sum(samples) / len(samples)
    return [s / mean for s in samples]
