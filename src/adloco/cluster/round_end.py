"""The end of a round, written once for every driver: ``adloco train``'s cluster (several worker slots on a rank)
and ``adloco.DiLoCo`` (one worker per rank: a user's loop, the HF Trainer, Lightning, fault-tolerant replicas).

In order: the strategy's exchanges and outer steps; the workers that failed restart from θ; each trainer taking
part here learns its workers' dispersion (a sharded worker's summed over its shards); the batch side decides those
trainers' next b; every trainer's state and reports reach every rank; the batch side learns the round's costs and
samples; the length side chooses the next round's H. A merge of trainers follows, where each driver has recorded
the round. What differs between the drivers is what they hold, not the order: the cluster's batch side plans M
workers per rank (``RoundBatches``), the loop's one worker's backward and sampler (``AdaptiveBatch``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from adloco.algorithms.sync_every import SyncDecision, dispersion
from adloco.cluster.trainers import synchronize
from adloco.comm.base import Communicator
from adloco.sync import RoundState, SyncStrategy
from adloco.sync.trainer import Trainer

# The workers' ‖Δ_i‖² and the mean's ‖Δ̄‖², each summed over the shards of a worker sharded over several ranks (each
# shard holds part of every norm). A driver packs them in its own order: with three or more shards the place of a
# value in the collective can change the order of its additions, and so its last bit.
ShardSum = Callable[[list[float], float], tuple[list[float], float]]


class BatchSide(Protocol):
    """What decides each trainer's batch at a round's end."""

    def decide(self, state: RoundState, trainers: Sequence[Trainer]) -> None:
        """The next b of ``trainers`` (those taking part on this rank) from the round's reports."""

    def learn(self, state: RoundState) -> None:
        """With every trainer's reports on every rank: the costs the round measured and the samples it read."""

    def pinned_seconds(self) -> tuple[float, float] | None:
        """(t, c) as the config pins them, at the b just decided; None where they are measured."""


class LengthSide(Protocol):
    """What chooses the next round's H."""

    def choose(
        self, state: RoundState, trainers: Iterable[Trainer], pinned: tuple[float, float] | None
    ) -> SyncDecision:
        """H for the next round (a fixed H kept, with the round's figures)."""


class RoundEnd:
    """The round's end over one strategy's trainers. ``restart``: the driver's own way to restart the workers the
    round's reports mark out (their inner optimizer's state dropped); ``shard_sum``: given where a worker spans
    several ranks."""

    def __init__(
        self,
        sync: SyncStrategy,
        comm: Communicator,
        trainers: Mapping[int, Trainer],
        restart: Callable[[RoundState], None],
        shard_sum: ShardSum | None = None,
    ) -> None:
        self.sync, self.comm, self.trainers = sync, comm, trainers
        self.restart, self.shard_sum = restart, shard_sum
        self.exchange_seconds = float("nan")  # the last round end's exchanges, wall time

    def __call__(self, state: RoundState, batch: BatchSide | None, length: LengthSide) -> SyncDecision:
        started = time.perf_counter()
        self.sync.end_of_round(state)
        self.exchange_seconds = time.perf_counter() - started
        self.restart(state)
        taking_part = self.sync.taking_part()
        for trainer in taking_part:
            trainer.dispersion = self._dispersion(trainer, state)
        if batch is not None:
            batch.decide(state, taking_part)
        synchronize(self.comm, self.trainers, state)
        if batch is not None:
            batch.learn(state)
        pinned = None if batch is None else batch.pinned_seconds()
        return length.choose(state, self.trainers.values(), pinned)

    def _dispersion(self, trainer: Trainer, state: RoundState) -> float:
        """The spread of the trainer's workers' Δ in the round's exchanges, over every shard of each worker."""
        drift = self.sync.take_drift(trainer.trainer_id)
        worker_sq, mean_sq = drift.worker_sq, drift.mean_sq
        if self.shard_sum is not None:
            workers = sorted(worker_sq)
            summed, mean_sq = self.shard_sum([worker_sq[w] for w in workers], mean_sq)
            worker_sq = dict(zip(workers, summed, strict=True))
        return dispersion(worker_sq, mean_sq, state.weights)
