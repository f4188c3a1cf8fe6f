"""DiLoCo with a whole round of overlap (arXiv 2502.12996): Δ travels while the next round computes.

At a round boundary the workers' reports are gathered (a small blocking exchange: who was healthy), this
round's Δ is sent without waiting, and the Δ sent a round ago, which has had a whole round to arrive, is
applied. ``delayed``: θ takes that stale mean and every worker restarts from θ. ``eager``: each worker keeps its
own outer parameters and momentum and steps them with the stale mean in which its own stale share is swapped
for its fresh one, so its own latest drift is never late; θ itself lags by one exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import torch
from torch.futures import Future

from adloco.algorithms.outer import OuterFactory, OuterOptimizer, eager_pseudo_gradient, worker_delta
from adloco.config import OuterConfig
from adloco.sync.base import DeltaStrategy, completed, pending_item
from adloco.sync.exchange import weighted
from adloco.sync.trainer import Trainer
from adloco.workers.reports import RoundState


class EagerCopy:
    """Eager updates: a worker's own outer parameters and outer momentum, and its share of the mean Δ
    still in flight. Workers start rounds from their own copies; θ itself lags them by one exchange."""

    def __init__(
        self, theta: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool, factory: OuterFactory | None
    ) -> None:
        self.theta = [t.detach().clone() for t in theta]
        self.outer = OuterOptimizer(self.theta, lr=lr, momentum=momentum, nesterov=nesterov, factory=factory)
        self.share: list[torch.Tensor] | None = None

    def state_dict(self) -> dict:
        return {
            "theta": [t.clone() for t in self.theta],
            "outer": self.outer.state_dict(),
            "share": None if self.share is None else [t.clone() for t in self.share],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for t, saved in zip(self.theta, state["theta"], strict=True):
            t.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.share = None if state["share"] is None else [t.clone() for t in state["share"]]

    @torch.no_grad()
    def start_from(self, trainer: Trainer) -> None:
        """θ and outer momentum from the trainer's, no share in flight: a worker that joins a running job."""
        for t, theta in zip(self.theta, trainer.theta, strict=True):
            t.copy_(theta)
        # a copy: torch's load_state_dict keeps tensors already on the right device, which would alias the
        # trainer's momentum and step it twice
        self.outer.load_state_dict(deepcopy(trainer.outers[0].state_dict()))
        self.share = None

    @torch.no_grad()
    def step(self, arrived: Sequence[torch.Tensor] | None, fresh: list[torch.Tensor] | None) -> None:
        """Outer step with the arrived mean, this worker's stale share swapped for its fresh one."""
        if arrived is not None or self.share is not None or fresh is not None:
            self.outer.step(eager_pseudo_gradient(arrived, self.share, fresh))
        self.share = fresh


class OverlappedSync(DeltaStrategy):
    """``outer.overlap=delayed`` (``eager=False``) or ``eager``."""

    def __init__(self, *parts: Any, outer: OuterConfig, eager: bool, outer_factory: OuterFactory | None = None) -> None:
        """``parts``: DeltaStrategy's (comm, trainers, workers, exchange); the config's ``outer`` section."""
        super().__init__(*parts)
        self.eager = {
            w: EagerCopy(t.theta, outer.lr, outer.momentum, bool(outer.nesterov), outer_factory)
            for t in self.trainers.values()
            for w in t.worker_ids
            if eager and w in self.workers
        }
        self.pending: dict[int, Future] = {}  # trainer -> mean Δ sent at the last round boundary

    def end_of_round(self, state: RoundState) -> None:
        for trainer in self.taking_part():
            self.gather_reports(state, trainer)
            key = trainer.trainer_id
            arrived = self._arrived(trainer, self.pending.pop(key)) if key in self.pending else None
            fresh: dict[int, list[torch.Tensor]] = {}
            if not self.mark_skipped(state, trainer):
                fresh = self._send(state, trainer)
            self._apply(trainer, arrived, fresh)

    def _arrived(self, trainer: Trainer, future: Future) -> list[torch.Tensor] | None:
        """The mean Δ sent a round ago; None when that exchange was dropped (a fault-tolerant one that failed): no
        outer step takes it, and an eager worker takes back the share it had applied of it."""
        exchanged = self.comm.wait(future)
        return None if exchanged.dropped else self.applied(trainer, exchanged)

    def _send(self, state: RoundState, trainer: Trainer) -> dict[int, list[torch.Tensor]]:
        """Start this round's exchange; return each eager worker's fresh share of the mean it will become."""
        hosted = self.hosted(trainer)
        bases = {w: self.eager[w].theta for w in hosted if w in self.eager} or None
        weight = {w: state.weights.get(w, 1.0) for w in trainer.worker_ids}
        healthy = math.fsum(weight[w] for w in trainer.worker_ids if not state.reports[w].out)
        # The reports went ahead of Δ, so Δ travels alone: the same bytes as DiLoCo's single exchange.
        future = self.exchange.start(
            trainer, 0, self.workers, state.out, healthy=healthy, bases=bases, weights=state.weights
        )
        self.pending[trainer.trainer_id] = future
        return {
            w: [d.div_(healthy) for d in weighted(worker_delta(self.eager[w].theta, self.workers[w].params), weight[w])]
            for w in hosted
            if w in self.eager and not state.reports[w].out
        }

    @torch.no_grad()
    def _apply(
        self, trainer: Trainer, arrived: list[torch.Tensor] | None, fresh: dict[int, list[torch.Tensor]]
    ) -> None:
        if arrived is not None:
            trainer.outer_step(0, arrived)
        for worker_id in self.hosted(trainer):
            copy = self.eager.get(worker_id)
            if copy is None:
                self.workers[worker_id].load_params(trainer.theta)
                continue
            copy.step(arrived, fresh.get(worker_id))
            self.workers[worker_id].load_params(copy.theta)

    def flush(self) -> None:
        for key in sorted(self.pending):
            trainer = self.trainers[key]
            arrived = self._arrived(trainer, self.pending.pop(key))
            if arrived is not None:
                trainer.outer_step(0, arrived)
            trainer.broadcast(self.workers)

    def worker_state(self, worker_id: int) -> dict:
        copy = self.eager.get(worker_id)
        return {**super().worker_state(worker_id), "eager": None if copy is None else copy.state_dict()}

    def load_worker_state(self, worker_id: int, state: dict) -> None:
        super().load_worker_state(worker_id, state)
        copy = self.eager.get(worker_id)
        if copy is not None and state["eager"] is not None:  # None: saved before the copy was kept
            copy.load_state_dict(state["eager"])
            self.workers[worker_id].load_params(copy.theta)  # it starts the next round from its own copy

    def join_worker(self, worker_id: int) -> None:
        copy = self.eager.get(worker_id)
        if copy is not None:
            copy.start_from(next(t for t in self.trainers.values() if worker_id in t.worker_ids))
            self.workers[worker_id].load_params(copy.theta)

    def state_dict(self) -> dict:
        return {f"{k}/0": pending_item(0, future.wait()) for k, future in self.pending.items()}

    def load_state_dict(self, pending: dict) -> None:
        self.pending = {int(key.split("/")[0]): completed(item) for key, item in pending.items()}
