"""One trainer (model instance): global parameters θ, its outer optimizers, its workers, batch size and batch test.

How θ is updated (when, from which exchange) is the sync strategy's business (``adloco.sync``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from adloco.algorithms.batch_tests import (
    BatchDecision,
    BatchSizeController,
    GradientStatistics,
    statistics_from_gram,
)
from adloco.algorithms.controller import TimeAwareController, TimedDecision, resolvable_noise_scale
from adloco.algorithms.outer import OuterFactory, OuterOptimizer
from adloco.algorithms.schedules import BatchCoupling
from adloco.checkpoint import CheckpointError
from adloco.comm.base import Communicator
from adloco.worker import Worker

if TYPE_CHECKING:
    from adloco.pace import Pace


class Trainer:
    """A DiLoCo group: workers start each round from θ; the outer step turns their mean drift into a step on θ."""

    def __init__(
        self,
        trainer_id: int,
        theta: Sequence[torch.Tensor],
        worker_ids: Sequence[int],
        batch_size: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        controller: BatchSizeController,
        fragments: Sequence[Sequence[int]] | None = None,
        coupling: BatchCoupling | None = None,
        timed: TimeAwareController | None = None,
        outer_factory: OuterFactory | None = None,
    ) -> None:
        self.trainer_id = trainer_id
        self.theta = [t.detach().clone().float() for t in theta]
        self.worker_ids = sorted(worker_ids)
        self.batch_size = batch_size
        # One outer optimizer per fragment (a single one covering θ unless streaming): a fragment that does
        # not sync gets no gradient, so its momentum cannot leak.
        self.fragments = [list(range(len(self.theta)))] if fragments is None else [list(f) for f in fragments]
        self.outers = [
            OuterOptimizer(
                [self.theta[i] for i in fragment],
                lr=outer_lr,
                momentum=outer_momentum,
                nesterov=nesterov,
                factory=outer_factory,
            )
            for fragment in self.fragments
        ]
        self.momentum = outer_momentum
        self.controller = controller
        self.coupling = coupling or BatchCoupling(b_start=batch_size)
        self.timed = timed  # the time-aware controller; None: the batch test decides
        self.last_decision: BatchDecision | None = None
        self.last_timed: TimedDecision | None = None

    @property
    def lr_scale(self) -> float:
        """The factor on its workers' inner lr at the current batch size."""
        return self.coupling.lr_scale(self.batch_size)

    def couple_inner_optimizers(self, workers: Mapping[int, Worker]) -> None:
        """Give the hosted workers' AdamW the β2 of the current batch size."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                worker = workers[worker_id]
                worker.set_beta2(self.coupling.beta2(worker.beta2, self.batch_size))

    def broadcast(self, workers: Mapping[int, Worker]) -> None:
        """Overwrite the hosted workers' parameters with θ (their AdamW state is kept)."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                workers[worker_id].load_params(self.theta)

    @torch.no_grad()
    def outer_step(self, index: int, delta: Sequence[torch.Tensor]) -> None:
        """θ_p ← OuterOpt_p(θ_p, Δ_p) for fragment ``index`` (the whole of θ unless streaming)."""
        self.outers[index].step(delta)

    def momentum_buffers(self) -> list[torch.Tensor | None]:
        """Outer momentum per θ tensor, in parameter order, whatever the fragments."""
        buffers: list[torch.Tensor | None] = [None] * len(self.theta)
        for fragment, outer in zip(self.fragments, self.outers, strict=True):
            for i, buffer in zip(fragment, outer.momentum_buffers(), strict=True):
                buffers[i] = buffer
        return buffers

    def set_momentum_buffers(self, buffers: Sequence[torch.Tensor | None]) -> None:
        for fragment, outer in zip(self.fragments, self.outers, strict=True):
            outer.set_momentum_buffers([buffers[i] for i in fragment])

    def adopt_worker_params(self, workers: Mapping[int, Worker]) -> None:
        """DDP keeps every worker identical, so θ is any worker's parameters; no exchange is needed."""
        hosted = [w for w in self.worker_ids if w in workers]
        with torch.no_grad():
            for t, p in zip(self.theta, workers[hosted[0]].params, strict=True):
                t.copy_(p)

    def cross_worker_statistics(self, comm: Communicator, workers: Mapping[int, Worker]) -> GradientStatistics:
        """The paper's estimator: the workers' last gradients, gathered (M·|θ| of traffic)."""
        local = {w: [workers[w].last_gradient] for w in self.worker_ids if w in workers}
        gathered = comm.wait(comm.gather_over_workers(local, self.worker_ids))
        stacked = torch.stack([g[0] for g in gathered]).double()
        gram = comm.sum_over_shards(stacked @ stacked.T)  # sharded workers: each rank gathered its rows
        return statistics_from_gram(gram, [self.batch_size] * len(self.worker_ids))

    def decide_batch(self, statistics: GradientStatistics, pace: Pace | None = None) -> BatchDecision:
        """The next b: the batch test's, or (time-aware) the fastest batch from the test's smoothed statistics."""
        decision = self.controller.decide(statistics, len(self.worker_ids), self.batch_size)
        self.last_decision = decision
        if self.timed is None or pace is None:
            self.batch_size = decision.b_req
            return decision
        workers = len(self.worker_ids)
        # An EMA of weight e averages the statistics of about (1 + e) / (1 - e) rounds (its variance shrinks so).
        rounds = (1.0 + self.controller.ema) / (1.0 - self.controller.ema)
        samples = workers * self.batch_size * rounds
        noise = resolvable_noise_scale(decision.sample_variance, decision.grad_norm_sq, samples)
        timed = self.timed.decide(
            noise, workers, self.batch_size, pace.cost, pace.round_seconds, pace.sync_every, pace.limit
        )
        self.batch_size, self.last_timed = timed.b_req, timed
        return decision

    def decision_record(self) -> dict | None:
        """The last decision for the metrics log."""
        if self.last_decision is None:
            return None
        record = self.last_decision.to_dict()
        if self.last_timed is not None:
            record.update(b_req=self.last_timed.b_req, timed=self.last_timed.to_dict())
        return record

    def sync_metadata(self) -> dict:
        """What other ranks need besides θ and momentum to mirror this trainer."""
        return {
            "batch_size": self.batch_size,
            "worker_ids": list(self.worker_ids),
            "controller": self.controller.state_dict(),
            "timed": None if self.timed is None else self.timed.state_dict(),
            "last_decision": self.last_decision,
            "last_timed": self.last_timed,
            "has_momentum": any(b is not None for b in self.momentum_buffers()),
        }

    def load_sync_metadata(self, meta: dict) -> None:
        self.batch_size = meta["batch_size"]
        self.worker_ids = list(meta["worker_ids"])
        self.controller.load_state_dict(meta["controller"])
        if self.timed is not None:
            self.timed.load_state_dict(meta["timed"])
        self.last_decision, self.last_timed = meta["last_decision"], meta["last_timed"]

    def state_dict(self) -> dict:
        return {
            "trainer_id": self.trainer_id,
            "theta": [t.clone() for t in self.theta],
            "worker_ids": list(self.worker_ids),
            "batch_size": self.batch_size,
            "outer": [outer.state_dict() for outer in self.outers],
            "controller": self.controller.state_dict(),
            **({"timed": self.timed.state_dict()} if self.timed is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        shapes = [tuple(t.shape) for t in state["theta"]]
        if shapes != [tuple(t.shape) for t in self.theta]:
            raise CheckpointError("the checkpoint holds parameters of another model shape than this config builds")
        with torch.no_grad():
            for t, saved in zip(self.theta, state["theta"], strict=True):
                t.copy_(saved)
        self.worker_ids = list(state["worker_ids"])
        self.batch_size = int(state["batch_size"])
        for outer, saved in zip(self.outers, state["outer"], strict=True):
            outer.load_state_dict(saved)
        self.controller.load_state_dict(state["controller"])
        if self.timed is not None and "timed" in state:
            self.timed.load_state_dict(state["timed"])
