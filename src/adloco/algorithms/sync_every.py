"""``sync_every=auto``: H, the inner steps per round, chosen while training from what a round costs and how far
the workers drift apart (docs/results/auto-sync.md derives the rule and says what it was calibrated on).

Cost model. A round of H inner steps takes H·t + c seconds: t the compute seconds per inner step of the busiest
rank, c the exposed exchange seconds of a round (wall time not spent computing). Drifting apart for longer loses
a little progress per step; model the loss as a factor (1 + H/H_d) on the steps a target needs, with H_d the
*drift scale* in inner steps. Time per unit of progress is then (t + c/H)·(1 + H/H_d), least at

    H* = sqrt(H_d · c / t),

the square-root rule of every interval-versus-overhead trade-off (checkpoint intervals, Young 1974). At H* the
exposed exchange fraction is about sqrt(c / (t·H_d)): a slow link is met with long rounds, a free one with short.

Phases. H_d grows as the inner lr decays (H_d / (η_t/η_peak), as AdaComm and QSR grow H while the lr falls: the
same drift in steps costs less as the steps shrink); during the lr warm-up it stays at its base. Dispersion is
the outer-level norm test: with M workers' pseudo-gradients Δ_i and their mean Δ̄,

    δ = (mean ‖Δ_i‖² / ‖Δ̄‖² − 1) / (M − 1)

estimates Var(Δ̄)/‖Δ̄‖², the squared relative error of the round's step. Independent noise around a common
direction keeps δ ≤ 1; δ > 1 says the workers' drifts cancel more than noise would: they went apart. Then H
halves at once, whatever the costs say. H starts at ``start``, goes straight to H* once a round's exchange has
been measured, and from then on moves at most ``max_growth``x per round; it stays a multiple of ``multiple``
(streaming's fragment count) within [``low``, ``high``].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

FOLLOW = 0.5  # weight of the newest round in the running means of t and c (as the time-aware controller's)
MAX_LR_STRETCH = 20.0  # the lr is read as no less than 1/this of its peak (sync_auto.lr_stretch)
REFERENCE_WORKERS = 2  # sync_auto.drift_steps is the drift scale of this many workers (docs/results/auto-sync.md)


def best_sync_every(step_seconds: float, exchange_seconds: float, drift_steps: float) -> float:
    """H* = sqrt(H_d · c / t): the H with the least predicted time per unit of progress (unbounded)."""
    if step_seconds <= 0.0 or not math.isfinite(step_seconds):
        return math.inf
    return math.sqrt(drift_steps * max(exchange_seconds, 0.0) / step_seconds)


def seconds_per_step(step_seconds: float, exchange_seconds: float, h: int, drift_steps: float) -> float:
    """Predicted seconds per unit of progress at H = ``h``: (t + c/H)·(1 + H/H_d)."""
    return (step_seconds + exchange_seconds / h) * (1.0 + h / drift_steps)


def drift_scale(base: float, lr_ratio: float, max_stretch: float = MAX_LR_STRETCH, power: float = 1.0) -> float:
    """H_d at an inner lr of ``lr_ratio`` × its peak (1.0 during warm-up): the base times (peak/lr)^``power``, the
    lr read as no less than 1/``max_stretch`` of its peak (power 1: H_d grows at most ``max_stretch`` times)."""
    return base / min(max(lr_ratio, 1.0 / max_stretch), 1.0) ** power


def drift_for_workers(drift_steps: float, workers: int, power: float) -> float:
    """The drift scale of ``workers`` workers averaged in each exchange, ``drift_steps`` being that of
    ``REFERENCE_WORKERS``: it falls as (REFERENCE_WORKERS / M)^``power`` (the fixed-H runs' tokens to a target put
    it lower at 4 workers than at 2: medians 194 against 763 over the benchmark's cells)."""
    return drift_steps * (REFERENCE_WORKERS / max(workers, 1)) ** power


def dispersion(worker_sq: Mapping[int, float], mean_sq: float, weights: Mapping[int, float] | None = None) -> float:
    """δ = (weighted mean of ‖Δ_i‖² / ‖Δ̄‖² − 1) / (M − 1) over the workers given; NaN below two workers or
    for a zero mean."""
    weights = weights or {}
    total = math.fsum(weights.get(w, 1.0) for w in worker_sq)
    if len(worker_sq) < 2 or mean_sq <= 0.0 or total <= 0.0:
        return math.nan
    mean_worker = math.fsum(weights.get(w, 1.0) * sq for w, sq in worker_sq.items()) / total
    return (mean_worker / mean_sq - 1.0) / (len(worker_sq) - 1)


@dataclass(frozen=True)
class SyncDecision:
    """One decision: the H of the next round, the H* it aims at, why, and what it was computed from."""

    sync_every: int
    target: float
    reason: str  # measuring | grow | shrink | hold | dispersion | min | max
    step_seconds: float
    exchange_seconds: float
    exposed_fraction: float  # c / (c + H·t) of the round just ended
    drift_steps: float
    dispersion: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


class AutoSyncEvery:
    """H chosen at each round boundary from the round's measured costs, the lr phase and the dispersion; the same
    inputs give the same H on every rank (they all come from the round's reports)."""

    def __init__(
        self,
        *,
        low: int,
        high: int,
        start: int,
        drift_steps: float,
        max_dispersion: float = 1.0,
        multiple: int = 1,
        max_growth: float = 2.0,
        lr_stretch: float = MAX_LR_STRETCH,
        lr_power: float = 1.0,
    ) -> None:
        if not 1 <= low <= high or low % multiple or high % multiple or drift_steps <= 0 or max_growth <= 1.0:
            raise ValueError(f"need 1 <= low <= high, both multiples of {multiple}, drift_steps > 0")
        if lr_stretch < 1.0:
            raise ValueError("need lr_stretch >= 1")
        self.lr_stretch, self.lr_power = lr_stretch, lr_power
        self.low, self.high, self.multiple = low, high, multiple
        self.drift_steps, self.max_dispersion, self.max_growth = drift_steps, max_dispersion, max_growth
        self.sync_every = self._bounded(start)
        self.step_seconds = math.nan  # running means, from the rounds measured so far
        self.exchange_seconds = math.nan
        self.settled = False  # whether a decision has been made (on measured costs, or by the guard): until then
        # the first decision on measured costs goes straight to H*, from then on H moves at most max_growth× a round

    def _drift(self, lr_ratio: float) -> float:
        return drift_scale(self.drift_steps, lr_ratio, self.lr_stretch, self.lr_power)

    def _bounded(self, h: float) -> int:
        """``h`` rounded to the nearest multiple of ``multiple`` within [low, high]."""
        rounded = self.multiple * max(1, round(h / self.multiple))
        return min(max(rounded, self.low), self.high)

    def length_for(self, step_seconds: float, exchange_seconds: float, lr_ratio: float = 1.0) -> int:
        """The bounded H* for these costs, with no limit on the move (what a batch decision plans with)."""
        drift = self._drift(lr_ratio)
        target = best_sync_every(step_seconds, exchange_seconds, drift)
        return self._bounded(min(target, self.high))

    def planner(self, round_seconds: float, lr_ratio: float = 1.0) -> Callable[[float], float]:
        """Seconds per unit of progress as a function of the step time t, each t at the H the rule would choose:
        what the time-aware batch controller weighs when b and H are chosen together. ``round_seconds``: the
        exchange seconds to assume until this rule has measured its own."""
        c = self.exchange_seconds if math.isfinite(self.exchange_seconds) else round_seconds
        drift = self._drift(lr_ratio)
        return lambda t: seconds_per_step(t, c, self.length_for(t, c, lr_ratio), drift)

    def observe(self, step_seconds: float, exchange_seconds: float) -> None:
        """Fold one round's measurements into the running means (a missing one is skipped)."""
        if math.isfinite(step_seconds) and step_seconds > 0:
            old = self.step_seconds
            self.step_seconds = step_seconds if math.isnan(old) else (1 - FOLLOW) * old + FOLLOW * step_seconds
        if math.isfinite(exchange_seconds) and exchange_seconds >= 0:
            old = self.exchange_seconds
            c = exchange_seconds
            self.exchange_seconds = c if math.isnan(old) else (1 - FOLLOW) * old + FOLLOW * c

    def decide(self, lr_ratio: float, spread: float = math.nan) -> SyncDecision:
        """The next round's H from the running costs, the inner lr (``lr_ratio`` of its peak) and the last
        exchange's dispersion ``spread``."""
        t, c, h = self.step_seconds, self.exchange_seconds, self.sync_every
        drift = self._drift(lr_ratio)
        exposed = c / (c + h * t) if math.isfinite(t) and math.isfinite(c) and c + h * t > 0 else math.nan
        if math.isfinite(spread) and spread > self.max_dispersion:
            target, reason = h / self.max_growth, "dispersion"
            self.sync_every, self.settled = self._bounded(target), True  # no jump back: grow again at the pace
        elif math.isnan(t) or math.isnan(c):
            target, reason = math.nan, "measuring"
        else:
            target = best_sync_every(t, c, drift)
            paced = min(max(target, h / self.max_growth), h * self.max_growth)
            moved = paced if self.settled else min(target, self.high)
            self.sync_every, self.settled = self._bounded(moved), True
            reason = self._reason(h, target)
        return SyncDecision(self.sync_every, target, reason, t, c, exposed, drift, spread)

    def _reason(self, before: int, target: float) -> str:
        if target <= self.low and self.sync_every == self.low:
            return "min"
        if target >= self.high and self.sync_every == self.high:
            return "max"
        return "grow" if self.sync_every > before else "shrink" if self.sync_every < before else "hold"

    def state_dict(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "step_seconds": self.step_seconds,
                "exchange_seconds": self.exchange_seconds, "settled": self.settled}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync_every = self._bounded(int(state["sync_every"]))
        self.step_seconds = float(state["step_seconds"])
        self.exchange_seconds = float(state["exchange_seconds"])
        self.settled = bool(state["settled"])
