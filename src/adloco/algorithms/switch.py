"""Switch mode: how a requested per-worker batch b_req becomes micro-batches, and the b_max search."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["MicroBatchPlan", "plan_micro_batches", "search_max_batch", "split_evenly"]

PlanMode = Literal["single", "capped", "accumulate"]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batch sizes of one inner step (one optimizer step) and why they were chosen.

    ``single``: one micro-batch of b_req; ``capped``: one micro-batch of b_max < b_req (the request is
    not served in full; the paper trades batch size for update frequency here); ``accumulate``: several
    near-equal micro-batches, larger first, summing to exactly b_req.
    """

    sizes: tuple[int, ...]
    mode: PlanMode

    @property
    def micro(self) -> int:
        """Largest micro-batch (what must fit in memory)."""
        return max(self.sizes)

    @property
    def accum(self) -> int:
        """Number of micro-batches accumulated into the step."""
        return len(self.sizes)

    @property
    def samples(self) -> int:
        """Samples behind the step's gradient."""
        return sum(self.sizes)


def split_evenly(total: int, parts: int) -> list[int]:
    """``parts`` near-equal positive sizes summing to ``total``, larger ones first (they differ by at most one)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def plan_micro_batches(b_req: int, b_max: int, switch_factor: float = 2.0) -> MicroBatchPlan:
    """Split a requested batch into micro-batches that fit in memory (switch mode).

    b_req ≤ b_max → one micro-batch of b_req; b_max < b_req ≤ n·b_max → one micro-batch of b_max;
    b_req > n·b_max → ⌈b_req/b_max⌉ near-equal micro-batches summing to b_req (n = ``switch_factor``;
    n = 1 accumulates as soon as b_req exceeds b_max).
    """
    _check_int("b_req", b_req, 1)
    _check_int("b_max", b_max, 1)
    if not (isinstance(switch_factor, (int, float)) and math.isfinite(switch_factor) and switch_factor >= 1):
        raise ValueError(f"switch_factor must be a finite number >= 1, got {switch_factor!r}")
    if b_req <= b_max:
        return MicroBatchPlan((b_req,), "single")
    if b_req <= switch_factor * b_max:
        return MicroBatchPlan((b_max,), "capped")
    return MicroBatchPlan(tuple(split_evenly(b_req, -(-b_req // b_max))), "accumulate")


def search_max_batch(fits: Callable[[int], bool], upper: int, lower: int = 1) -> int:
    """Largest b in [lower, upper] with ``fits(b)``, assuming fits is monotone (true up to some b).

    Doubles from ``lower`` until a probe fails or ``upper`` is reached, then bisects between the last
    success and the first failure: at most about log2(upper/lower) + log2(b_max) + 2 calls, each b
    probed at most once.
    Returns 0 when not even ``lower`` fits.
    """
    _check_int("lower", lower, 1)
    _check_int("upper", upper, lower)
    if not fits(lower):
        return 0
    good = lower
    bad: int | None = None
    while good < upper:
        probe = min(upper, good * 2)
        if fits(probe):
            good = probe
        else:
            bad = probe
            break
    if bad is None:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
