"""One trainer (model instance): global parameters θ, its outer optimizer, batch size and batch test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from adloco.algorithms.batch_tests import (
    BatchDecision,
    BatchSizeController,
    GradientStatistics,
    statistics_from_gram,
)
from adloco.algorithms.outer import OuterOptimizer, worker_delta
from adloco.comm.base import Communicator
from adloco.worker import Worker

_STAT_FIELDS = ("grad_norm_sq", "sample_variance", "ip_variance", "orth_variance")


@dataclass
class OuterStepReport:
    delta_norm: float


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
    ) -> None:
        self.trainer_id = trainer_id
        self.theta = [t.detach().clone().float() for t in theta]
        self.worker_ids = sorted(worker_ids)
        self.batch_size = batch_size
        self.outer = OuterOptimizer(self.theta, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self.controller = controller
        self.last_decision: BatchDecision | None = None
        self.pending_statistics: dict[int, GradientStatistics] = {}

    def broadcast(self, workers: Mapping[int, Worker]) -> None:
        """Overwrite the hosted workers' parameters with θ (their AdamW state is kept)."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                workers[worker_id].load_params(self.theta)

    def average_gradients(self, comm: Communicator, workers: Mapping[int, Worker]) -> None:
        """DDP: every hosted worker's gradient becomes the trainer-wide mean."""
        local = {w: workers[w].gradients() for w in self.worker_ids if w in workers}
        mean = comm.mean_over_workers(local, self.worker_ids).wait()
        for worker_id in local:
            workers[worker_id].set_gradients(mean)

    @torch.no_grad()
    def outer_step(self, comm: Communicator, workers: Mapping[int, Worker]) -> OuterStepReport:
        """Δ = mean_m (θ − θ_m) over the trainer's workers, then θ ← OuterOpt(θ, Δ) and broadcast."""
        local = {w: worker_delta(self.theta, workers[w].params) for w in self.worker_ids if w in workers}
        delta = comm.mean_over_workers(local, self.worker_ids).wait()
        self.outer.step(delta)
        self.broadcast(workers)
        return OuterStepReport(delta_norm=float(torch.sqrt(sum(d.double().square().sum() for d in delta))))

    def adopt_worker_params(self, workers: Mapping[int, Worker]) -> None:
        """DDP keeps every worker identical, so θ is any worker's parameters; no exchange is needed."""
        hosted = [w for w in self.worker_ids if w in workers]
        with torch.no_grad():
            for t, p in zip(self.theta, workers[hosted[0]].params, strict=True):
                t.copy_(p)

    def record_statistics(self, worker_id: int, statistics: GradientStatistics) -> None:
        self.pending_statistics[worker_id] = statistics

    def cross_worker_statistics(self, comm: Communicator, workers: Mapping[int, Worker]) -> GradientStatistics:
        """The paper's estimator: the workers' last gradients, gathered (M·|θ| of traffic)."""
        local = {w: [workers[w].last_gradient] for w in self.worker_ids if w in workers}
        gathered = comm.gather_over_workers(local, self.worker_ids).wait()
        stacked = torch.stack([g[0] for g in gathered]).double()
        return statistics_from_gram(stacked @ stacked.T, [self.batch_size] * len(self.worker_ids))

    def combine_statistics(self, comm: Communicator) -> GradientStatistics | None:
        """Average the workers' scalar statistics over the trainer: only scalars travel."""
        if not self.pending_statistics:
            return None
        local = {
            w: [s.samples] + [float("nan") if getattr(s, f) is None else getattr(s, f) for f in _STAT_FIELDS]
            for w, s in self.pending_statistics.items()
        }
        means = comm.mean_scalars(local, self.worker_ids)
        self.pending_statistics = {}
        values = {f: (None if v != v else v) for f, v in zip(_STAT_FIELDS, means[1:], strict=True)}
        return GradientStatistics(samples=round(means[0]), **values)

    def decide_batch(self, statistics: GradientStatistics) -> BatchDecision:
        decision = self.controller.decide(statistics, len(self.worker_ids), self.batch_size)
        self.batch_size = decision.b_req
        self.last_decision = decision
        return decision

    def sync_metadata(self) -> dict:
        """What other ranks need besides θ and momentum to mirror this trainer."""
        return {
            "batch_size": self.batch_size,
            "worker_ids": list(self.worker_ids),
            "controller": self.controller.state_dict(),
            "last_decision": self.last_decision,
            "has_momentum": any(b is not None for b in self.outer.momentum_buffers()),
        }

    def load_sync_metadata(self, meta: dict) -> None:
        self.batch_size = meta["batch_size"]
        self.worker_ids = list(meta["worker_ids"])
        self.controller.load_state_dict(meta["controller"])
        self.last_decision = meta["last_decision"]

    def state_dict(self) -> dict:
        return {
            "trainer_id": self.trainer_id,
            "theta": [t.clone() for t in self.theta],
            "worker_ids": list(self.worker_ids),
            "batch_size": self.batch_size,
            "outer": self.outer.state_dict(),
            "controller": self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for t, saved in zip(self.theta, state["theta"], strict=True):
                t.copy_(saved)
        self.worker_ids = list(state["worker_ids"])
        self.batch_size = int(state["batch_size"])
        self.outer.load_state_dict(state["outer"])
        self.controller.load_state_dict(state["controller"])
