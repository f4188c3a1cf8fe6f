"""One trainer's adaptive batch: b_req and the controllers that move it, from the round's scalar statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from adloco.algorithms.batch_tests import BatchDecision, BatchSizeController, GradientStatistics, average_statistics
from adloco.algorithms.controller import TimeAwareController, TimedDecision, resolvable_noise_scale
from adloco.algorithms.schedules import LR_EXPONENTS, BatchCoupling
from adloco.batch.pace import CostModel, Pace

if TYPE_CHECKING:
    from adloco.algorithms.sync_every import AutoSyncEvery
    from adloco.config import BatchConfig
    from adloco.workers.reports import WorkerRound


def batch_coupling(batch: BatchConfig) -> BatchCoupling:
    """How a trainer's inner lr and AdamW β2 follow its batch size, as ``batch`` configures it."""
    return BatchCoupling(
        b_start=batch.size,
        lr_exponent=LR_EXPONENTS[batch.scaling.lr],
        lr_cap=batch.scaling.lr_max,
        scale_beta2=batch.scaling.beta2,
    )


class TrainerBatch:
    """A trainer's per-worker batch b_req, the batch test that measures what it should be, the time-aware
    controller that weighs it against step and round costs (None: the test decides), and how the inner lr and
    β2 follow it. It changes only at a round's end, from statistics every worker of the trainer agrees on."""

    def __init__(
        self,
        size: int,
        controller: BatchSizeController,
        timed: TimeAwareController | None = None,
        coupling: BatchCoupling | None = None,
    ) -> None:
        self.size = size
        self.controller = controller
        self.timed = timed
        self.coupling = coupling or BatchCoupling(b_start=size)
        self.last_decision: BatchDecision | None = None
        self.last_timed: TimedDecision | None = None

    @classmethod
    def from_config(cls, batch: BatchConfig) -> TrainerBatch:
        """As the config's ``batch`` section says (``controller`` must be resolved: ``time`` or ``test``)."""
        assert batch.test is not None and batch.controller is not None
        controller = BatchSizeController(
            test=batch.test,
            eta=batch.statistics.eta,
            theta=batch.statistics.theta,
            nu=batch.statistics.nu,
            ema=batch.statistics.ema,
            b_min=batch.b_min,
            b_cap=batch.b_cap,
            allow_shrink=batch.allow_shrink,
        )
        timed = None
        if batch.controller == "time":
            timed = TimeAwareController(
                b_min=batch.b_min,
                b_cap=batch.b_cap,
                patience=batch.time.patience,
                max_growth=batch.time.max_growth,
                allow_shrink=batch.allow_shrink,
            )
        return cls(batch.size, controller, timed, batch_coupling(batch))

    @property
    def lr_scale(self) -> float:
        """The factor on the inner lr at the current batch size."""
        return self.coupling.lr_scale(self.size)

    def beta2(self, base: float) -> float:
        """AdamW's β2 at the current batch size, from the configured ``base``."""
        return self.coupling.beta2(base, self.size)

    def decide(self, statistics: GradientStatistics, workers: int, pace: Pace | None = None) -> BatchDecision:
        """The next b: the batch test's, or (time-aware, with a ``pace``) the fastest batch from the test's
        smoothed statistics. ``workers``: how many workers the trainer's global batch spreads over."""
        decision = self.controller.decide(statistics, workers, self.size)
        self.last_decision = decision
        if self.timed is None or pace is None:
            self.size = decision.b_req
            return decision
        # An EMA of weight e averages the statistics of about (1 + e) / (1 - e) rounds (its variance shrinks so).
        rounds = (1.0 + self.controller.ema) / (1.0 - self.controller.ema)
        samples = workers * self.size * rounds
        noise = resolvable_noise_scale(decision.sample_variance, decision.grad_norm_sq, samples)
        timed = self.timed.decide(noise, workers, self.size, pace.cost, pace.round_seconds, pace.sync_every,
                                  pace.limit, pace.per_step)  # fmt: skip
        self.size, self.last_timed = timed.b_req, timed
        return decision

    def decide_from_reports(self, reports: Sequence[WorkerRound], pace: Pace | None = None) -> BatchDecision | None:
        """The decision from the workers' own statistics in their round reports (the microbatch estimator); none
        where a worker left the round or measured nothing (a partial measurement is not a measurement)."""
        if any(r.out or r.statistics is None for r in reports):
            return None
        return self.decide(average_statistics([r.statistics for r in reports if r.statistics is not None]),
                           len(reports), pace)  # fmt: skip

    def decision_record(self) -> dict | None:
        """The last decision for the metrics log."""
        if self.last_decision is None:
            return None
        record = self.last_decision.to_dict()
        if self.last_timed is not None:
            record.update(b_req=self.last_timed.b_req, timed=self.last_timed.to_dict())
        return record

    def mirror(self) -> dict[str, Any]:
        """What another rank needs to hold the same batch (its decisions included)."""
        return {**self.state_dict(), "last_decision": self.last_decision, "last_timed": self.last_timed}

    def load_mirror(self, mirror: dict[str, Any]) -> None:
        self.load_state_dict(mirror)
        self.last_decision, self.last_timed = mirror["last_decision"], mirror["last_timed"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.size,
            "controller": self.controller.state_dict(),
            "timed": None if self.timed is None else self.timed.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size = int(state["batch_size"])
        self.controller.load_state_dict(state["controller"])
        if self.timed is not None and state["timed"] is not None:  # None: saved before the time-aware controller
            self.timed.load_state_dict(state["timed"])


def pace_for(
    batch: BatchConfig,
    costs: CostModel | None,
    worker_ids: Sequence[int],
    sync_every: int,
    tokens_left: int | None,
    tokens_per_sample: int,
    total_workers: int,
    auto: AutoSyncEvery | None = None,
    lr_ratio: float = 1.0,
) -> Pace | None:
    """The costs a time-aware decision weighs for a trainer of ``worker_ids``; b grows only while the budget
    (``tokens_left``) holds ``batch.time.min_steps_left`` steps of every worker. With ``sync_every=auto``
    (``auto``) each candidate b is weighed at the H the rule would choose for its step time at the coming round's
    inner lr over its peak (``lr_ratio``): b and H chosen together."""
    if costs is None or batch.controller != "time":
        return None
    limit = None
    if tokens_left is not None:
        limit = tokens_left // (batch.time.min_steps_left * tokens_per_sample * total_workers)
    cost = costs.trainer_cost(worker_ids, balanced=batch.shares == "speed")
    pace = Pace(cost, costs.round_seconds, sync_every, limit)
    if auto is not None:
        pace.per_step = auto.planner(pace.round_seconds, lr_ratio)
    return pace
