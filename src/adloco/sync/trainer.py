"""One trainer (model instance): global parameters θ, its outer optimizers, its workers and its adaptive batch.

How θ is updated (when, from which exchange) is the sync strategy's business (``adloco.sync``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from adloco.algorithms.batch_tests import GradientStatistics, statistics_from_gram
from adloco.algorithms.outer import ElementState, OuterFactory, OuterOptimizer
from adloco.checkpoint import CheckpointError
from adloco.comm.base import Communicator
from adloco.errors import ConfigError
from adloco.workers.worker import Worker

if TYPE_CHECKING:
    from adloco.batch.policy import TrainerBatch


HOST_FROM_PARAMETERS = 100_000_000  # adloco.DiLoCo's outer.device=auto: host memory from this size on (docs/gpu.md)


def theta_device(setting: str, model_device: torch.device, parameters: int, user_loop: bool) -> torch.device:
    """Where a trainer keeps θ and its outer state for ``outer.device`` = ``setting``: host memory for ``cpu`` (and
    for ``auto`` in adloco train, or from HOST_FROM_PARAMETERS parameters in a user's loop), beside the workers for
    ``cuda``."""
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("outer.device: cuda was asked for but no CUDA device is available")
        return model_device if model_device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    if setting == "auto" and user_loop and parameters < HOST_FROM_PARAMETERS:
        return model_device
    return torch.device("cpu")


class Trainer:
    """A DiLoCo group: workers start each round from θ; the outer step turns their mean drift into a step on θ."""

    def __init__(
        self,
        trainer_id: int,
        theta: Sequence[torch.Tensor],
        worker_ids: Sequence[int],
        batch: TrainerBatch,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        fragments: Sequence[Sequence[int]] | None = None,
        outer_factory: OuterFactory | None = None,
    ) -> None:
        self.trainer_id = trainer_id
        self.theta = [t.detach().clone().float() for t in theta]
        if self.theta and self.theta[0].device.type == "cpu" and torch.cuda.is_available():
            self.theta = [t.pin_memory() for t in self.theta]  # copies to and from a GPU without staging
        self.worker_ids = sorted(worker_ids)
        self.batch = batch  # b_req and what decides it: the batch policy's (adloco.batch)
        self.dispersion = math.nan  # its workers' pseudo-gradient dispersion δ in the last round (sync_every)
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

    @property
    def batch_size(self) -> int:
        """b_req: samples per worker per inner step."""
        return self.batch.size

    @batch_size.setter
    def batch_size(self, size: int) -> None:
        self.batch.size = size

    def couple_inner_optimizers(self, workers: Mapping[int, Worker]) -> None:
        """Give the hosted workers' AdamW the β2 of the current batch size."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                worker = workers[worker_id]
                worker.set_beta2(self.batch.beta2(worker.beta2))

    def broadcast(self, workers: Mapping[int, Worker]) -> None:
        """Overwrite the hosted workers' parameters with θ (their AdamW state is kept)."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                workers[worker_id].load_params(self.theta)

    @torch.no_grad()
    def outer_step(self, index: int, delta: Sequence[torch.Tensor]) -> None:
        """θ_p ← OuterOpt_p(θ_p, Δ_p) for fragment ``index`` (the whole of θ unless streaming)."""
        self.outers[index].step(delta)

    def outer_state(self) -> tuple[ElementState, dict[int, dict]]:
        """The outer optimizers' state keyed by θ position, whatever the fragments: the tensors shaped like
        their parameter (momentum, Adam's moments) and the rest (step counts)."""
        tensors: ElementState = {}
        scalars: dict[int, dict] = {}
        for fragment, outer in zip(self.fragments, self.outers, strict=True):
            tensors.update({(fragment[i], name): t for (i, name), t in outer.element_state().items()})
            scalars.update({fragment[i]: entries for i, entries in outer.scalar_state().items()})
        return tensors, scalars

    def load_outer_state(self, tensors: ElementState, scalars: dict[int, dict]) -> None:
        """Replace the outer optimizers' state with (copies of) ``outer_state``'s two parts."""
        for fragment, outer in zip(self.fragments, self.outers, strict=True):
            position = {theta_index: k for k, theta_index in enumerate(fragment)}
            outer.load_element_state(
                {(position[i], name): t for (i, name), t in tensors.items() if i in position},
                {position[i]: entries for i, entries in scalars.items() if i in position},
            )

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

    def sync_metadata(self) -> dict:
        """What other ranks need besides θ and the outer state to mirror this trainer."""
        return {
            **self.batch.mirror(),
            "worker_ids": list(self.worker_ids),
            "dispersion": self.dispersion,
        }

    def load_sync_metadata(self, meta: dict) -> None:
        self.batch.load_mirror(meta)
        self.worker_ids = list(meta["worker_ids"])
        self.dispersion = float(meta["dispersion"])

    def state_dict(self) -> dict:
        return {
            "trainer_id": self.trainer_id,
            "theta": [t.clone() for t in self.theta],
            "worker_ids": list(self.worker_ids),
            "batch_size": self.batch_size,
            "outer": [outer.state_dict() for outer in self.outers],
            **self.batch.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        shapes = [tuple(t.shape) for t in state["theta"]]
        if shapes != [tuple(t.shape) for t in self.theta]:
            raise CheckpointError("the checkpoint holds parameters of another model shape than this config builds")
        with torch.no_grad():
            for t, saved in zip(self.theta, state["theta"], strict=True):
                t.copy_(saved)
        self.worker_ids = list(state["worker_ids"])
        for outer, saved in zip(self.outers, state["outer"], strict=True):
            outer.load_state_dict(saved)
        self.batch.load_state_dict(state)
