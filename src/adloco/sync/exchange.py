"""The pseudo-gradient exchange every DiLoCo-family strategy shares: each hosted worker's Δ of one fragment,
optionally encoded (with error feedback), gathered with the workers' reports in one collective, and averaged
over the workers that were not out of the round."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

import torch
from torch.futures import Future

from adloco.algorithms.codecs import Codec, Encoded, ErrorFeedback, decode_and_average
from adloco.algorithms.flat import flatten, unflatten
from adloco.algorithms.outer import worker_delta
from adloco.comm.base import Communicator, Gathered
from adloco.sync.trainer import Trainer
from adloco.workers.reports import absent_report
from adloco.workers.worker import Worker


@dataclass
class Drift:
    """How far a trainer's workers went in a round: each healthy worker's ‖Δ_i‖² and the mean's ‖Δ̄‖², summed
    over the fragments exchanged (the inputs of ``algorithms.sync_every.dispersion``)."""

    worker_sq: dict[int, float] = field(default_factory=dict)
    mean_sq: float = 0.0

    def add(self, other: Drift) -> None:
        for w, sq in other.worker_sq.items():
            self.worker_sq[w] = self.worker_sq.get(w, 0.0) + sq
        self.mean_sq += other.mean_sq


@dataclass
class Exchanged:
    """The mean Δ of one fragment over the healthy workers, every worker's report that came with it, and the
    workers' drift."""

    mean: list[torch.Tensor]
    reports: dict[int, torch.Tensor]
    drift: Drift = field(default_factory=Drift)
    dropped: bool = False  # every worker absent: a fault-tolerant exchange that failed


def healthy_weight(reports: Mapping[int, torch.Tensor], weights: Mapping[int, float]) -> float:
    """The summed weight of the workers whose report does not say ``out`` (the first value of every report)."""
    return math.fsum(weights.get(w, 1.0) for w, r in reports.items() if r[0].item() == 0.0)


def weighted(delta: list[torch.Tensor], weight: float) -> list[torch.Tensor]:
    """Δ scaled in place by its worker's sample weight; untouched at 1.0 so equal shares keep their bits."""
    if weight != 1.0:
        for t in delta:
            t.mul_(weight)
    return delta


def squared_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Σ‖t‖² accumulated in float64 without a float64 copy of each tensor."""
    return math.fsum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2 for t in tensors)


def _exchanged(
    mean: list[torch.Tensor], gathered: Gathered, reported: bool, width: int, device: torch.device, workers: int
) -> Exchanged:
    """Split each row into the worker's report and its ‖Δ_i‖² (the row's last value). A report's first value says
    whether the worker was out; without reports (the caller knew who was healthy) a worker that sent zeros was.
    A worker absent from the exchange reads as out (``width``: the rows' length, report and ‖Δ_i‖²). The mean
    goes to θ's ``device``: a transport may hand rows back in host memory (gloo, or any exchange's rows)."""
    mean = [t.to(device) for t in mean]
    width = width or gathered.report_width  # this rank sent no row (another trainer's exchange on a replica)
    rows = dict(gathered.reports)
    if reported and gathered.absent:  # an absent worker's row: its report, then ‖Δ_i‖² = 0
        # Built only when a worker is absent (a fault-tolerant replica that died), not at every exchange.
        rows = gathered.reports_with_absent(torch.cat([absent_report(width - 1), torch.zeros(1, dtype=torch.float64)]))
    healthy = {w: float(r[-1]) for w, r in rows.items() if (r[0].item() == 0.0 if reported else r[-1].item() > 0.0)}
    reports = {w: r[:-1] for w, r in rows.items()} if reported else {}
    dropped = len(gathered.absent) >= workers
    return Exchanged(mean=mean, reports=reports, drift=Drift(healthy, squared_norm(mean)), dropped=dropped)


def _deltas(
    trainer: Trainer,
    fragment: Sequence[int],
    workers: Mapping[int, Worker],
    out: Set[int],
    reports: Mapping[int, torch.Tensor] | None,
    bases: Mapping[int, Sequence[torch.Tensor]] | None,
    weights: Mapping[int, float],
) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
    """Each hosted worker's weighted Δ of ``fragment`` (zeros when out), and the row that travels with it: its
    report, if any, then its ‖Δ_i‖² (one float64: the round's dispersion, for free)."""
    theta = [trainer.theta[i] for i in fragment]
    local, rows = {}, {}
    for w in trainer.worker_ids:
        if w not in workers:
            continue
        if w in out:
            local[w] = [torch.zeros_like(t) for t in theta]
        else:
            base = theta if bases is None else [bases[w][i] for i in fragment]
            params = workers[w].params  # once: a loop's worker builds the list anew at each access
            local[w] = worker_delta(base, [params[i] for i in fragment])
        drift = torch.tensor([squared_norm(local[w])], dtype=torch.float64)
        rows[w] = drift if reports is None else torch.cat([reports[w].to(drift.device, torch.float64), drift])
        weighted(local[w], weights.get(w, 1.0))
    return local, rows


class DeltaExchange:
    """Start exchanges of Δ = θ − θ_m; the caller decides when to wait for them."""

    def __init__(
        self,
        comm: Communicator,
        codec: Codec | None,
        error_feedback: bool,
        hosted: Sequence[int],
        feedback_decay: float = 1.0,
    ) -> None:
        self.comm = comm
        self.codec = codec
        # What quantization dropped, per hosted worker, added back to its next exchange of the same fragment.
        on = codec is not None and error_feedback
        self.feedback = {w: ErrorFeedback(feedback_decay) for w in hosted} if on else {}
        self.peak_sync_bytes = 0

    def start(
        self,
        trainer: Trainer,
        index: int,
        workers: Mapping[int, Worker],
        out: Set[int],
        reports: Mapping[int, torch.Tensor] | None = None,
        healthy: float | None = None,
        bases: Mapping[int, Sequence[torch.Tensor]] | None = None,
        weights: Mapping[int, float] | None = None,
    ) -> Future[Exchanged]:
        """Exchange fragment ``index`` of ``trainer``; a hosted worker in ``out`` sends zeros.

        Each hosted worker's ``reports`` vector travels in the same collective; its first value says whether
        the worker is out, and the mean is over the others. Without reports the caller already knows the
        ``healthy`` workers' summed weight. Δ is measured from θ, or from each worker's own starting point in
        ``bases``. The mean weighs each worker by ``weights`` (its samples over the trainer's mean; 1.0 each
        when absent).
        """
        weights = weights or {}
        if (reports is None) == (healthy is None):
            raise ValueError("an exchange needs either the workers' reports or the healthy count")
        fragment = trainer.fragments[index]
        local, rows = _deltas(trainer, fragment, workers, out, reports, bases, weights)
        self._count(trainer, fragment)
        reported = reports is not None
        width = next(iter(rows.values())).numel() if rows else 0
        device = trainer.theta[fragment[0]].device

        def divisor(gathered: Gathered) -> float:
            total = healthy_weight(gathered.reports, weights) if healthy is None else healthy
            return total or len(trainer.worker_ids)  # nobody healthy: the zeros stay zeros

        if self.codec is None:

            def averaged(done: Future) -> Exchanged:
                gathered: Gathered = done.wait()
                assert gathered.total is not None
                mean = [t.div_(divisor(gathered)) for t in gathered.total]
                return _exchanged(mean, gathered, reported, width, device, len(trainer.worker_ids))

            return self.comm.sum_with_reports(local, rows, trainer.worker_ids).then(averaged)
        key = f"{trainer.trainer_id}/{index}"
        payloads = {w: self._encode(key, w, delta, w in out) for w, delta in local.items()}
        like = [trainer.theta[i] for i in fragment]  # Δ's shapes, where this rank sent none
        numel = sum(t.numel() for t in like)
        codec = self.codec  # the callback runs on gloo's thread: it must hold no group handle (not this object)
        assert codec is not None

        def decode(done: Future) -> Exchanged:
            gathered: Gathered = done.wait()
            assert gathered.rows is not None
            encoded = [Encoded(codes=c, scales=s if s.numel() else None, numel=numel) for c, s in gathered.rows]
            flat = decode_and_average(encoded, codec, divisor=divisor(gathered))
            return _exchanged(unflatten(flat, like), gathered, reported, width, device, len(trainer.worker_ids))

        return self.comm.gather_with_reports(payloads, rows, trainer.worker_ids).then(decode)

    def _encode(self, key: str, worker_id: int, delta: list[torch.Tensor], out: bool) -> list[torch.Tensor]:
        assert self.codec is not None
        flat = flatten(delta)
        feedback = None if out else self.feedback.get(worker_id)
        if feedback is not None:
            flat = feedback.compensate(key, flat)
        encoded = self.codec.encode(flat)
        if feedback is not None:
            feedback.record(key, flat, self.codec.decode(encoded))
        no_scales = torch.zeros(0, dtype=torch.uint8, device=encoded.codes.device)  # one row, one device
        return [encoded.codes, encoded.scales if encoded.scales is not None else no_scales]

    def _count(self, trainer: Trainer, fragment: Sequence[int]) -> None:
        """Track the largest single exchange: every worker's payload for one fragment."""
        numel = sum(trainer.theta[i].numel() for i in fragment)
        per_worker = 4 * numel if self.codec is None else self.codec.encoded_nbytes(numel)
        self.peak_sync_bytes = max(self.peak_sync_bytes, per_worker * len(trainer.worker_ids))

    def worker_state(self, worker_id: int) -> dict | None:
        feedback = self.feedback.get(worker_id)
        return None if feedback is None else feedback.state_dict()

    def load_worker_state(self, worker_id: int, state: dict | None) -> None:
        if worker_id in self.feedback and state is not None:
            self.feedback[worker_id].load_state_dict(state)
