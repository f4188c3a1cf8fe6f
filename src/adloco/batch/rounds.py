"""The batch policy's side of ``adloco train``'s rounds, for every trainer of the run: each trainer's switch-mode
plan and its workers' shares (equal, or by speed), the samples and tokens of a step, H for the round, whether
its statistics are due, and the decisions at its end (each trainer's ``TrainerBatch``, from the round's reports).
Every rank holds the same trainers, b_max table and costs, so every rank plans and decides alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from adloco.algorithms.shares import balanced_split, sample_weights
from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches
from adloco.batch.policy import pace_for

if TYPE_CHECKING:
    from adloco.algorithms.batch_tests import GradientStatistics
    from adloco.config import BatchConfig
    from adloco.pace import CostModel, Pace
    from adloco.sync import RoundState
    from adloco.trainer import Trainer


class RoundBatches:
    """The trainers' batches around a round. It holds the run's trainers, b_max table and cost model (shared with
    the cluster, which changes them in place: merges, out-of-memory retries, resumes)."""

    def __init__(
        self,
        batch: BatchConfig,
        trainers: Mapping[int, Trainer],
        b_max: Mapping[int, int],
        costs: CostModel | None,
        shape: tuple[int, int, int],
        collect_statistics: bool,
    ) -> None:
        self.batch, self.trainers, self.b_max, self.costs = batch, trainers, b_max, costs
        self.total_workers, self.sync_every, self.context = shape  # (workers, H, tokens per sample)
        self.collect_statistics = collect_statistics

    def worker_plan(self, worker_id: int, b_req: int) -> MicroBatchPlan:
        return plan_micro_batches(b_req, self.b_max[worker_id], self.batch.switch_factor)

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
        """H, or with ``batch.keep_round_time`` H scaled down by how many more samples a step reads than at the
        start (the same on every rank: it follows the plans)."""
        if not self.batch.keep_round_time:
            return self.sync_every
        start = self.batch.size * self.total_workers
        return max(1, round(self.sync_every * start / sum(self.samples_per_step().values())))

    def statistics_due(self, round_index: int) -> bool:
        return self.collect_statistics and round_index % self.batch.test_every == 0

    def decide(
        self,
        state: RoundState,
        taking_part: Iterable[Trainer],
        cross_worker: Callable[[Trainer], GradientStatistics],
        tokens_left: int | None = None,
    ) -> None:
        """The batch test of each trainer this rank takes part in, from the statistics in the round's reports."""
        if not state.statistics_due:
            return
        for trainer in taking_part:
            reports = [state.reports[w] for w in trainer.worker_ids]
            if self.batch.estimator != "cross_worker":
                trainer.batch.decide_from_reports(reports, self.pace(trainer, tokens_left))
            elif not any(r.out for r in reports):  # a partial measurement is not a measurement
                statistics = cross_worker(trainer)
                trainer.batch.decide(statistics, len(reports), self.pace(trainer, tokens_left))

    def pace(self, trainer: Trainer, tokens_left: int | None) -> Pace | None:
        """What a time-aware decision weighs; H as it stands now: trainers decided earlier count with their new b."""
        return pace_for(self.batch, self.costs, trainer.worker_ids, self.inner_steps_per_round(), tokens_left,
                        self.context, self.total_workers)  # fmt: skip
