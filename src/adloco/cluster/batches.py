"""The batch policy's side of ``adloco train``'s rounds, for every trainer of the run: each trainer's switch-mode
plan and its workers' shares (equal, or by speed), the samples and tokens of a step, H for the round, whether
its statistics are due, and the decisions at its end (each trainer's ``TrainerBatch``, from the round's reports).
Every rank holds the same trainers, b_max table and costs, so every rank plans and decides alike."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from adloco.algorithms.shares import balanced_split, sample_weights
from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches
from adloco.algorithms.sync_every import AutoSyncEvery, SyncDecision, drift_for_workers
from adloco.batch.policy import pace_for
from adloco.workers.reports import exchange_time

if TYPE_CHECKING:
    from adloco.algorithms.batch_tests import GradientStatistics
    from adloco.batch.pace import CostModel, Pace
    from adloco.config import BatchConfig, StreamingConfig, SyncAutoConfig
    from adloco.sync import RoundState
    from adloco.sync.trainer import Trainer


class RoundBatches:
    """The trainers' batches around a round. It holds the run's trainers, b_max table and cost model (shared with
    the cluster, which changes them in place: merges, out-of-memory retries, resumes)."""

    def __init__(
        self,
        batch: BatchConfig,
        trainers: Mapping[int, Trainer],
        b_max: dict[int, int],
        costs: CostModel | None,
        shape: tuple[int, int, int],
        collect_statistics: bool,
        worker_rank: Mapping[int, int],
        cross_worker: Callable[[Trainer], GradientStatistics],
        auto: AutoSyncEvery | None = None,
    ) -> None:
        self.batch, self.trainers, self.b_max, self.costs = batch, trainers, b_max, costs
        self.total_workers, self.sync_every, self.context = shape  # (workers, H, tokens per sample)
        self.collect_statistics = collect_statistics
        self.worker_rank = worker_rank  # where each worker's steps run: a rank's hosted workers take turns
        self.cross_worker = cross_worker  # a trainer's statistics from its workers' Δ (estimator cross_worker)
        self.auto = auto  # sync_every=auto: H chosen at each round's end
        # set by the cluster at each round's end, before the batch decisions: the plan the round ran (samples per
        # step of each worker), the inner lr of the coming round over its peak, the token budget left after the round
        self.round_samples: dict[int, int] = {}
        self.lr_ratio = 1.0
        self.tokens_left: int | None = None

    def worker_plan(self, worker_id: int, b_req: int) -> MicroBatchPlan:
        return plan_micro_batches(b_req, self.b_max[worker_id], self.batch.memory.switch_factor)

    def plans(self) -> dict[int, MicroBatchPlan]:
        """Each trainer's switch-mode plan for its current b_req (on its first worker's device)."""
        return {k: self.worker_plan(t.worker_ids[0], t.batch_size) for k, t in self.trainers.items()}

    def shares(self, trainer: Trainer) -> dict[int, int]:
        """Each worker's part of the trainer's M·b_req samples per step: b_req each, or in proportion to speed.
        Every rank holds the same costs (pinned, or corrected from the same reports), so all split alike."""
        if self.batch.shares == "equal" or len(trainer.worker_ids) == 1:
            return dict.fromkeys(trainer.worker_ids, trainer.batch_size)
        assert self.costs is not None
        costs = [self.costs.worker_cost(w) for w in trainer.worker_ids]
        split = balanced_split(trainer.batch_size * len(trainer.worker_ids), costs)
        return dict(zip(trainer.worker_ids, split, strict=True))

    def samples_per_step(self) -> dict[int, int]:
        """Samples each worker (of every trainer) reads per inner step, following its switch-mode plan."""
        return {
            w: self.worker_plan(w, share).samples for t in self.trainers.values() for w, share in self.shares(t).items()
        }

    def sample_weights(self, samples: Mapping[int, int]) -> dict[int, float]:
        """Each worker's weight in its trainer's mean pseudo-gradient: its samples over the trainer's mean."""
        weights = {}
        for t in self.trainers.values():
            weights.update(zip(t.worker_ids, sample_weights([samples[w] for w in t.worker_ids]), strict=True))
        return weights

    def tokens_per_step(self) -> int:
        """Tokens one inner step reads over all workers."""
        return sum(self.samples_per_step().values()) * self.context

    def inner_steps_per_round(self) -> int:
        """H (with ``sync_every=auto`` as last decided), or with ``batch.time.keep_round_time`` H scaled down by how
        many more samples a step reads than at the start (the same on every rank: it follows the plans)."""
        if self.auto is not None:
            return self.auto.sync_every
        if not self.batch.time.keep_round_time:
            return self.sync_every
        start = self.batch.size * self.total_workers
        return max(1, round(self.sync_every * start / sum(self.samples_per_step().values())))

    def statistics_due(self, round_index: int) -> bool:
        return self.collect_statistics and round_index % self.batch.statistics.every == 0

    def decide(self, state: RoundState, trainers: Sequence[Trainer]) -> None:
        """The batch test of each trainer this rank takes part in, from the statistics in the round's reports."""
        if not state.statistics_due:
            return
        for trainer in trainers:
            reports = [state.reports[w] for w in trainer.worker_ids]
            if self.batch.statistics.estimator != "cross_worker":
                trainer.batch.decide_from_reports(reports, self.pace(trainer, self.tokens_left))
            elif not any(r.out for r in reports):  # a partial measurement is not a measurement
                statistics = self.cross_worker(trainer)
                trainer.batch.decide(statistics, len(reports), self.pace(trainer, self.tokens_left))

    def learn(self, state: RoundState) -> None:
        """Every rank holds every report: the same step costs and b_max table everywhere."""
        if self.costs is not None:
            self.costs.learn(state.reports, self.round_samples)
        self.b_max.update({w: r.b_max for w, r in state.reports.items()})

    def pace(self, trainer: Trainer, tokens_left: int | None) -> Pace | None:
        """What a time-aware decision weighs; H as it stands now: trainers decided earlier count with their new b."""
        return pace_for(self.batch, self.costs, trainer.worker_ids, self.inner_steps_per_round(), tokens_left,
                        self.context, self.total_workers, self.auto, self.lr_ratio)  # fmt: skip

    def choose(
        self, state: RoundState, trainers: Iterable[Trainer], pinned: tuple[float, float] | None
    ) -> SyncDecision:
        """The next round's H from every worker's report (the same on every rank); a fixed H is kept, with the
        same figures recorded."""
        return next_sync_every(self.auto, self.inner_steps_per_round(), state, self.worker_rank, trainers,
                               self.lr_ratio, pinned)  # fmt: skip

    def pinned_seconds(self) -> tuple[float, float] | None:
        """(t, c) as ``batch.time.step_seconds`` and ``round_seconds`` pin them (``pinned_seconds``)."""
        return pinned_seconds(self.costs, self.samples_per_step(), self.worker_rank)


def pinned_seconds(
    costs: CostModel | None, samples: Mapping[int, int], worker_rank: Mapping[int, int]
) -> tuple[float, float] | None:
    """(t, c) as ``batch.time.step_seconds`` and ``round_seconds`` pin them, both given: the busiest rank's step
    at each worker's ``samples`` per step and the round's overhead; None where either is measured."""
    if costs is None or costs.follow_steps or costs.pinned_round is None:
        return None
    per_worker = {w: costs.worker_cost(w).at(n) for w, n in samples.items()}
    return busiest_rank(per_worker, worker_rank), costs.pinned_round


def busiest_rank(seconds: Mapping[int, float], worker_rank: Mapping[int, int]) -> float:
    """The largest per-rank sum of its hosted workers' seconds (NaN where none is finite): a rank hosting
    several workers runs their steps one after another."""
    per_rank: dict[int, float] = {}
    for w, s in seconds.items():
        if math.isfinite(s):
            per_rank[worker_rank[w]] = per_rank.get(worker_rank[w], 0.0) + s
    return max(per_rank.values(), default=math.nan)


def next_sync_every(
    auto: AutoSyncEvery | None,
    current: int,
    state: RoundState,
    worker_rank: Mapping[int, int],
    trainers: Iterable[Trainer],
    lr_ratio: float = 1.0,
    pinned: tuple[float, float] | None = None,
) -> SyncDecision:
    """H for the next round from the round's reports and the trainers' dispersion, all the same on every rank:
    the busiest rank's compute seconds per step (its hosted workers' summed), the largest exchange overhead
    a rank reported, the largest dispersion. ``pinned``: (t, c) from the config instead of the reports.
    ``auto`` None: H stays ``current``, its figures recorded."""
    step_seconds = busiest_rank({w: r.step_seconds for w, r in state.reports.items()}, worker_rank)
    exchange_seconds = exchange_time(state.reports.values())
    if pinned is not None:
        step_seconds, exchange_seconds = pinned
    spread = max((t.dispersion for t in trainers if math.isfinite(t.dispersion)), default=math.nan)
    if auto is not None:
        auto.observe(step_seconds, exchange_seconds)
        return auto.decide(lr_ratio, spread)
    total = exchange_seconds + current * step_seconds
    exposed = exchange_seconds / total if math.isfinite(total) and total > 0 else math.nan
    return SyncDecision(current, math.nan, "fixed", step_seconds, exchange_seconds, exposed, math.nan, spread)


def auto_sync_every(
    sync_every: int | str | None, auto: SyncAutoConfig, streaming: StreamingConfig, workers: int | None
) -> AutoSyncEvery | None:
    """The rule that chooses H while training when ``sync_every`` is auto (None: H stays fixed), from the
    ``sync_auto`` section; H stays a multiple of streaming's fragments and the drift scale falls with the
    ``workers`` of a trainer."""
    if sync_every != "auto":
        return None
    low, high = auto.bounds(streaming.fragments)
    # Streaming with α > 0 keeps part of each worker's own drift after a sync, by design: its workers' Δ differ
    # by more than noise every round, so there the dispersion is recorded but does not shrink H.
    guard = auto.max_dispersion if not streaming.alpha else math.inf
    assert workers is not None
    drift = drift_for_workers(auto.drift_steps, workers, auto.workers_power)
    return AutoSyncEvery(low=low, high=high, start=auto.first(streaming.fragments), drift_steps=drift,
                         max_dispersion=guard, multiple=streaming.fragments or 1,
                         lr_stretch=auto.lr_stretch, lr_power=auto.lr_power)  # fmt: skip
