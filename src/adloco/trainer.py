"""One trainer (model instance): global parameters θ, its outer optimizer, batch size and batch test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import torch
from torch.futures import Future

from adloco.algorithms.batch_tests import (
    BatchDecision,
    BatchSizeController,
    GradientStatistics,
    statistics_from_gram,
)
from adloco.algorithms.codecs import Codec, Encoded
from adloco.algorithms.fragments import mix
from adloco.algorithms.outer import OuterOptimizer, eager_pseudo_gradient, sum_in_order, worker_delta
from adloco.checkpoint import CheckpointError
from adloco.comm.base import Communicator
from adloco.worker import Worker


def _split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


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
        fragments: Sequence[Sequence[int]] | None = None,
        codec: Codec | None = None,
    ) -> None:
        self.trainer_id = trainer_id
        self.theta = [t.detach().clone().float() for t in theta]
        self.worker_ids = sorted(worker_ids)
        self.batch_size = batch_size
        # One outer optimizer per fragment (a single one covering θ unless streaming): a fragment that does
        # not sync gets no gradient, so its momentum cannot leak.
        self.fragments = [list(range(len(self.theta)))] if fragments is None else [list(f) for f in fragments]
        self.outers = [
            OuterOptimizer([self.theta[i] for i in fragment], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            for fragment in self.fragments
        ]
        self.momentum = outer_momentum
        self.codec = codec
        self.controller = controller
        self.last_decision: BatchDecision | None = None
        self.pending_statistics: dict[int, GradientStatistics] = {}

    def broadcast(self, workers: Mapping[int, Worker]) -> None:
        """Overwrite the hosted workers' parameters with θ (their AdamW state is kept)."""
        for worker_id in self.worker_ids:
            if worker_id in workers:
                workers[worker_id].load_params(self.theta)

    def healthy_count(self, excluded: Set[int]) -> int:
        return sum(1 for w in self.worker_ids if w not in excluded)

    def average_gradients(
        self, comm: Communicator, workers: Mapping[int, Worker], excluded: Set[int] = frozenset()
    ) -> None:
        """DDP: every hosted worker's gradient becomes the mean over the trainer's healthy workers."""
        local = {
            w: [torch.zeros_like(p) for p in workers[w].params] if w in excluded else workers[w].gradients()
            for w in self.worker_ids
            if w in workers
        }
        mean = comm.mean_over_workers(local, self.worker_ids, self.healthy_count(excluded)).wait()
        for worker_id in local:
            workers[worker_id].set_gradients(mean)

    @torch.no_grad()
    def outer_step(
        self, comm: Communicator, workers: Mapping[int, Worker], excluded: Set[int] = frozenset()
    ) -> OuterStepReport:
        """Δ = mean_m (θ − θ_m) over the trainer's healthy workers, then θ ← OuterOpt(θ, Δ) and broadcast."""
        delta = self.send_fragment(0, comm, workers, excluded).wait()
        self.apply_fragment(0, delta, workers, alpha=0.0)
        return OuterStepReport(delta_norm=float(torch.sqrt(sum(d.double().square().sum() for d in delta))))

    @torch.no_grad()
    def send_fragment(
        self,
        index: int,
        comm: Communicator,
        workers: Mapping[int, Worker],
        excluded: Set[int] = frozenset(),
        bases: Mapping[int, Sequence[torch.Tensor]] | None = None,
    ) -> Future:
        """Start exchanging fragment ``index``'s pseudo-gradient; the future holds the healthy workers' mean Δ.

        Each worker's Δ is measured from θ, or from its own starting point in ``bases`` (eager updates,
        where workers start a round from slightly different parameters).
        """
        fragment = self.fragments[index]
        theta = [self.theta[i] for i in fragment]
        local = {
            w: [torch.zeros_like(t) for t in theta]
            if w in excluded
            else worker_delta(
                theta if bases is None else [bases[w][i] for i in fragment], [workers[w].params[i] for i in fragment]
            )
            for w in self.worker_ids
            if w in workers
        }
        divisor = self.healthy_count(excluded)
        if self.codec is None:
            return comm.mean_over_workers(local, self.worker_ids, divisor)
        return self._exchange_encoded(index, local, comm, workers, excluded, divisor)

    def _exchange_encoded(
        self,
        index: int,
        local: dict[int, list[torch.Tensor]],
        comm: Communicator,
        workers: Mapping[int, Worker],
        excluded: Set[int],
        divisor: int,
    ) -> Future:
        """Each worker encodes its own Δ; codes and scales are gathered, decoded and averaged in float32."""
        codec = self.codec
        assert codec is not None
        like = next(iter(local.values()))
        key = f"{self.trainer_id}/{index}"
        payloads = {}
        for worker_id, delta in local.items():
            flat = torch.cat([d.reshape(-1) for d in delta])
            feedback = None if worker_id in excluded else workers[worker_id].error_feedback
            if feedback is not None:
                flat = feedback.compensate(key, flat)
            encoded = codec.encode(flat)
            if feedback is not None:
                feedback.record(key, flat, codec.decode(encoded))
            scales = encoded.scales if encoded.scales is not None else torch.zeros(0, dtype=torch.float32)
            payloads[worker_id] = [encoded.codes, scales]
        numel = sum(t.numel() for t in like)

        def decode(future: Future) -> list[torch.Tensor]:
            decoded = []
            for codes, scales in future.wait():
                encoded = Encoded(codes=codes, scales=scales if scales.numel() else None, numel=numel)
                flat = codec.decode(encoded).reshape(-1)
                decoded.append(_split_like(flat, like))
            total = sum_in_order(decoded)
            return [t.div_(divisor) for t in total]

        return comm.gather_over_workers(payloads, self.worker_ids).then(decode)

    @torch.no_grad()
    def apply_fragment(
        self, index: int, delta: Sequence[torch.Tensor], workers: Mapping[int, Worker], alpha: float
    ) -> None:
        """θ_p ← OuterOpt_p(θ_p, Δ_p); hosted workers' fragment ← α·local + (1 − α)·θ_p."""
        fragment = self.fragments[index]
        self.outers[index].step(delta)
        for worker_id in self.worker_ids:
            if worker_id not in workers:
                continue
            params = workers[worker_id].params
            for i in fragment:
                params[i].copy_(
                    self.theta[i] if alpha == 0 else mix(params[i], self.theta[i].to(params[i].device), alpha)
                )

    @torch.no_grad()
    def apply_overlapped(
        self,
        arrived: Sequence[torch.Tensor] | None,
        fresh_shares: Mapping[int, list[torch.Tensor]],
        workers: Mapping[int, Worker],
    ) -> None:
        """End of a round with a full round of overlap: θ takes the mean Δ that has just arrived (a round
        late); each hosted worker restarts from θ (delayed) or from its own eager copy (eager), whose outer
        step swaps its stale share of the arrived mean for its fresh one."""
        if arrived is not None:
            self.outers[0].step(arrived)
        for worker_id in self.worker_ids:
            if worker_id not in workers:
                continue
            worker = workers[worker_id]
            if worker.eager is None:
                worker.load_params(self.theta)
                continue
            eager = worker.eager
            fresh = fresh_shares.get(worker_id)
            if arrived is not None or eager.share is not None or fresh is not None:
                eager.outer.step(eager_pseudo_gradient(arrived, eager.share, fresh))
            eager.share = fresh
            worker.load_params(eager.theta)

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
            "has_momentum": any(b is not None for b in self.momentum_buffers()),
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
            "outer": [outer.state_dict() for outer in self.outers],
            "controller": self.controller.state_dict(),
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
