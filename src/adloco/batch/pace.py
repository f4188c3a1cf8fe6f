"""What steps and rounds cost on this hardware and link, for the time-aware batch controller.

Each rank times a few real training steps of its device at start-up; the line through them is its workers'
step cost t(b). During training every worker's round report carries its measured seconds per step and its
rank's overhead of the previous round (wall time not spent computing: exchanges, waits, outer steps), so every
rank updates the same cost model from the same numbers and makes the same batch decisions.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adloco.algorithms.controller import StepCost, fit_step_cost
from adloco.algorithms.shares import balanced_cost
from adloco.workers.reports import WorkerRound, exchange_time

if TYPE_CHECKING:
    from adloco.config import BatchTimeConfig

log = logging.getLogger(__name__)

FOLLOW = 0.5  # weight of the newest round in the running corrections


def timed_batches(b_start: int, b_top: int) -> list[int]:
    """The per-worker batches timed at start-up: b_start, 2·b_start, 4·b_start, 8·b_start, up to b_top."""
    return sorted({min(b_start * 2**i, b_top) for i in range(4)})


def time_steps(step_at: Callable[[int], None], batches: Iterable[int], repeats: int = 3) -> StepCost:
    """Median seconds of ``repeats`` real steps at each batch (after one untimed warm-up), fitted to a line."""
    points = []
    for b in batches:
        step_at(b)
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            step_at(b)
            seconds.append(time.perf_counter() - started)
        points.append((b, statistics.median(seconds)))
    cost = fit_step_cost(points)
    log.info("step times %s -> t(b) = %.4g + %.4g·b s", points, cost.overhead, cost.per_sample)
    return cost


@dataclass
class Pace:
    """One trainer's costs for a decision: per-worker step cost, the round's overhead, H, the budget's limit."""

    cost: StepCost
    round_seconds: float
    sync_every: int
    limit: int | None
    per_step: Callable[[float], float] | None = None  # sync_every=auto: seconds per step at step time t, H its own


class CostModel:
    """Every worker's step cost and the rounds' overhead, corrected by what the round reports measure.

    ``follow_steps`` False keeps the step costs as given (pinned in the config); ``round_seconds`` not None pins
    the round overhead. With both pinned the decisions depend on the statistics only and reproduce exactly.
    """

    def __init__(self, base: Mapping[int, StepCost], follow_steps: bool, round_seconds: float | None) -> None:
        self.base = dict(base)
        self.follow_steps = follow_steps
        self.pinned_round = round_seconds
        self.factor = dict.fromkeys(self.base, 1.0)
        self.round_seconds = round_seconds or 0.0

    def learn(self, reports: Mapping[int, WorkerRound], samples: Mapping[int, int]) -> None:
        """Fold in one round's measurements (``samples``: each worker's samples per step that round)."""
        if self.follow_steps:
            for w, report in reports.items():
                predicted = self.base[w].at(samples[w])
                if math.isfinite(report.step_seconds) and report.step_seconds > 0 and predicted > 0:
                    ratio = report.step_seconds / predicted
                    self.factor[w] = (1 - FOLLOW) * self.factor[w] + FOLLOW * ratio
        exchange = exchange_time(reports.values())
        if self.pinned_round is None and math.isfinite(exchange):
            self.round_seconds = (1 - FOLLOW) * self.round_seconds + FOLLOW * exchange

    def include(self, base: Mapping[int, StepCost]) -> None:
        """Workers the model has not met yet (another trainer's, whose reports a rank learns after the round)."""
        for worker_id, cost in base.items():
            if worker_id not in self.base:
                self.base[worker_id], self.factor[worker_id] = cost, 1.0

    def worker_cost(self, worker_id: int) -> StepCost:
        """One worker's step cost as the real steps have corrected it."""
        return self.base[worker_id].scaled(self.factor[worker_id])

    def trainer_cost(self, worker_ids: Iterable[int], balanced: bool = False) -> StepCost:
        """The trainer's step time at per-worker b. With equal shares the slowest worker gates its rounds (the
        upper envelope of their costs); with ``balanced`` shares every worker takes the same time."""
        costs = [self.worker_cost(w) for w in worker_ids]
        if balanced:
            return balanced_cost(costs)
        return StepCost(max(c.overhead for c in costs), max(c.per_sample for c in costs))

    def state_dict(self) -> dict:
        return {
            "base": {w: (c.overhead, c.per_sample) for w, c in self.base.items()},
            "factor": dict(self.factor),
            "round_seconds": self.round_seconds,
        }

    def load_state_dict(self, state: dict) -> None:
        saved_base = {int(w): StepCost(*c) for w, c in state["base"].items()}
        saved_factor = {int(w): float(f) for w, f in state["factor"].items()}
        # An elastic resize: workers the checkpoint does not know keep this start's measurement; retired ones go.
        self.base = {w: saved_base.get(w, cost) for w, cost in self.base.items()}
        self.factor = {w: saved_factor.get(w, 1.0) for w in self.base}
        if self.pinned_round is None:
            self.round_seconds = float(state["round_seconds"])


def pinned_costs(time: BatchTimeConfig, worker_ids: Iterable[int]) -> CostModel | None:
    """The cost model ``batch.time.step_seconds`` pins (one [a, c] for every worker, or one per worker id), or
    None."""
    if time.step_seconds is None:
        return None
    if isinstance(time.step_seconds, list):
        return CostModel({w: StepCost(*time.step_seconds[w]) for w in worker_ids}, False, time.round_seconds)
    return CostModel(dict.fromkeys(worker_ids, StepCost(*time.step_seconds)), False, time.round_seconds)
