"""The rank's compute engine: the inner steps of the worker slots this rank hosts, one at a time or stacked as one
group (``worker_group``), with the switch-mode micro-batches, a statistics step's groups, out-of-memory retries
(which lower the shared b_max table) and each worker's compute time."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from adloco.workers.group import WorkerGroup, stacking_blocker
from adloco.workers.reports import SKIPPED_STEP, RoundState, StepRecord
from adloco.workers.worker import StepResult, Worker

if TYPE_CHECKING:
    from adloco.config import BatchConfig

log = logging.getLogger(__name__)


def worker_groups(workers: Mapping[int, Worker], stacked: bool) -> list[WorkerGroup]:
    """The hosted workers as one stacked group, where the config asks for it and they can be stacked."""
    if not stacked:
        return []
    hosted = [workers[w] for w in sorted(workers)]
    reason = stacking_blocker(hosted)
    if reason is not None:
        log.info("workers run one at a time: %s", reason)
        return []
    return [WorkerGroup(hosted)]


class RankEngine:
    """This rank's workers and stacked groups, computing and applying inner steps. ``b_max`` is the run's table
    (shared with the cluster: an out-of-memory retry lowers it here, the round's reports spread it)."""

    def __init__(
        self, workers: Mapping[int, Worker], groups: list[WorkerGroup], b_max: dict[int, int], batch: BatchConfig
    ) -> None:
        self.workers, self.groups, self.b_max, self.batch = workers, groups, b_max, batch

    def step_workers(self, state: RoundState, stepping: set[int], lrs: dict[int, float]) -> None:
        """The inner optimizer step of the workers the strategy lets step; a group steps as one where it can."""
        pending = dict(self.workers)
        for group in self.groups:
            if not set(group.worker_ids) <= stepping:
                continue
            begun = time.perf_counter()
            if group.step([lrs[w] for w in group.worker_ids]):
                self._share_seconds(state, group.worker_ids, time.perf_counter() - begun)
                for worker_id in group.worker_ids:
                    del pending[worker_id]
        for worker_id, worker in pending.items():
            if worker_id in stepping:
                begun = time.perf_counter()
                worker.step(lrs[worker_id])
                state.compute_seconds[worker_id] += time.perf_counter() - begun
            else:
                worker.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def _share_seconds(state: RoundState, worker_ids: list[int], seconds: float) -> None:
        """A group's time, split evenly over its workers (each worker's cost is its share of the stacked step)."""
        for worker_id in worker_ids:
            state.compute_seconds[worker_id] += seconds / len(worker_ids)

    def compute(self, state: RoundState, step: int, samples: dict[int, int]) -> None:
        """One inner step's gradients on every hosted worker still in the round."""
        batch = self.batch
        cross_worker = state.statistics_due and batch.statistics.estimator == "cross_worker"
        stats_step = state.statistics_due and step == 0 and not cross_worker
        keep_gradient = cross_worker and step == state.steps - 1
        groups = batch.statistics.groups if stats_step else None
        done = set() if keep_gradient else self._compute_stacked(state, samples, groups)
        for worker_id in sorted(self.workers):
            record = state.local[worker_id]
            if worker_id in done:
                continue
            if record.out:
                record.steps.append(SKIPPED_STEP)
                continue
            begun = time.perf_counter()
            result: StepResult = self.workers[worker_id].compute_gradients(
                samples[worker_id],
                self.b_max[worker_id],
                stats_groups=groups,
                gram=batch.test == "inner_product",
                keep_gradient=keep_gradient,
            )
            state.compute_seconds[worker_id] += time.perf_counter() - begun
            self._record_step(state, worker_id, result)

    def _compute_stacked(self, state: RoundState, samples: dict[int, int], stats_groups: int | None) -> set[int]:
        """The groups whose workers are all in the round with one plan take their step as one; their ids."""
        done: set[int] = set()
        for group in self.groups:
            ids = group.worker_ids
            plans = {(samples[w], self.b_max[w]) for w in ids}
            if len(plans) != 1 or any(state.local[w].out for w in ids) or not group.fits:
                continue
            begun = time.perf_counter()
            gram = self.batch.test == "inner_product"
            results = group.compute_gradients(samples[ids[0]], self.b_max[ids[0]], stats_groups, gram)
            self._share_seconds(state, ids, time.perf_counter() - begun)
            for worker_id, result in zip(ids, results, strict=True):
                self._record_step(state, worker_id, result)
            done.update(ids)
        return done

    def _record_step(self, state: RoundState, worker_id: int, result: StepResult) -> None:
        record = state.local[worker_id]
        if result.b_max < self.b_max[worker_id]:
            self.b_max[worker_id] = record.b_max = result.b_max
        record.steps.append(StepRecord(loss=result.loss, tokens=result.tokens, finite=result.finite))
        if result.statistics is not None and result.finite:
            record.statistics = result.statistics
