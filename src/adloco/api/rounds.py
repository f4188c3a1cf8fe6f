"""How long a user's loop's rounds are: H fixed, or chosen at each round's end (``sync_every="auto"``) from the
loop's own timings and the workers' dispersion, which every rank learns from the round's reports. The shards of a
worker sharded over several ranks each exchange their own rows with their own reports: they take the largest times
over the worker's shard group (the round's end sums their parts of the dispersion), so every shard decides the same
H."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from adloco.algorithms.sync_every import AutoSyncEvery, SyncDecision
from adloco.api.worker import WorkerShards
from adloco.cluster.batches import busiest_rank, next_sync_every
from adloco.sync import RoundState, WorkerRound
from adloco.sync.trainer import Trainer
from adloco.workers.reports import exchange_time


class LoopRounds:
    """The rounds of a loop: their count, the H of the one in progress and the timings that choose the next."""

    def __init__(
        self,
        first: int,
        auto: AutoSyncEvery | None,
        lr: Callable[[], float],
        shards: WorkerShards | None = None,
    ) -> None:
        self.fixed = first  # H of the first round; every round's, without an auto rule
        self.lr = lr  # the inner optimizer's lr as the loop's schedule set it (the coming round's)
        self.shards = shards  # a sharded worker's shards decide (and record) from the whole worker's figures
        self.auto = auto  # None: H stays fixed
        self.count = 0  # rounds ended since the start
        self.last: SyncDecision | None = None  # the last round's H decision (or figures, for a fixed H)
        self.started = time.perf_counter()
        # the inner lr of the coming round over its peak: H grows as it falls. None: read off the optimizer's lr
        # at each round's end against the highest it has had (a warm-up rising to its peak reads as 1)
        self.lr_ratio: float | None = None
        self.peak_lr = 0.0

    @property
    def length(self) -> int:
        """H of the round in progress."""
        return self.fixed if self.auto is None else self.auto.sync_every

    def start(self) -> None:
        self.started = time.perf_counter()

    def stamp(self, record: WorkerRound, steps: int, exchange_seconds: float) -> None:
        """The round's wall time per step (everything the loop does between exchanges) and the last boundary's
        exchange time (``exchange_seconds``, its exposed exchange) into this worker's report; a batch policy's own
        step timings stand."""
        if math.isnan(record.step_seconds):
            record.step_seconds = (time.perf_counter() - self.started) / max(steps, 1)
        if math.isnan(record.overhead_seconds) or self.auto is not None:
            record.overhead_seconds = exchange_seconds

    def ratio(self, lr: float) -> float:
        """The inner lr ``lr`` over the highest it has had (``lr_ratio`` where the loop gives it)."""
        peak = max(self.peak_lr, lr)
        return self.lr_ratio if self.lr_ratio is not None else (lr / peak if peak > 0 else 1.0)

    def choose(
        self, state: RoundState, trainers: Iterable[Trainer], pinned: tuple[float, float] | None = None
    ) -> SyncDecision:
        """Once every trainer's reports and dispersion reached every rank: the next round's H, at the inner
        learning rate the loop's optimizer now has; ``pinned``: (t, c) as the batch's pinned costs give them,
        instead of the reports' (AdLoCo on pinned costs, as adloco train)."""
        ranks = {w: w for w in state.reports}  # one worker per rank
        if self.shards is not None and pinned is None:  # the slowest shard's step and exchange, on every shard
            step = busiest_rank({w: r.step_seconds for w, r in state.reports.items()}, ranks)
            pinned = tuple(self.shards.largest([step, exchange_time(state.reports.values())]))
        lr = self.lr()
        ratio = self.ratio(lr)
        self.peak_lr = max(self.peak_lr, lr)
        self.last = next_sync_every(self.auto, self.length, state, ranks, trainers, ratio, pinned)
        self.count += 1
        return self.last

    def state_dict(self) -> dict[str, Any]:
        auto = None if self.auto is None else self.auto.state_dict()
        return {"rounds": self.count, "sync_every": auto, "peak_lr": self.peak_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["rounds"])
        self.peak_lr = float(state["peak_lr"])
        if self.auto is not None:
            self.auto.load_state_dict(state["sync_every"])


def first_group_lr(optimizer: torch.optim.Optimizer) -> Callable[[], float]:
    """The inner optimizer's lr (its first group's), as the loop's schedule sets it, read when asked. Through a weak
    reference: the rounds go to DiLoCo's finalizer, and the optimizer's hooks lead back to DiLoCo, which would then
    live as long as the process."""
    held = weakref.ref(optimizer)

    def lr() -> float:
        optimizer = held()
        assert optimizer is not None, "the inner optimizer is gone"
        return float(optimizer.param_groups[0]["lr"])

    return lr
