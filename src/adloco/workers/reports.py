"""What a round leaves behind: each worker's steps, statistics and b_max, packed to travel with an exchange."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from adloco.algorithms.batch_tests import GradientStatistics

_STAT_FIELDS = ("samples", "grad_norm_sq", "sample_variance", "ip_variance", "orth_variance")
_FLAGS = 7  # out, b_max, stop signal, checkpoint asked, seconds per step, the rank's previous round overhead and
# its time between rounds before it
_HEAD = _FLAGS + len(_STAT_FIELDS)
_PER_STEP = 3  # loss, tokens, finite


@dataclass
class StepRecord:
    """One worker's inner step: its mean loss, the tokens it read, and whether loss and gradient were finite."""

    loss: float
    tokens: int
    finite: bool


SKIPPED_STEP = StepRecord(loss=math.nan, tokens=0, finite=False)  # a worker out of the round reads nothing
ABSENT_B_MAX = -1  # the b_max an absent worker's report carries (a present one's is a count, at least 0)


@dataclass(frozen=True)
class BoundaryRequest:
    """What a rank asks of the coming round boundary: stop there (the signal's number, 0 for none), or write a
    checkpoint there (its time cadence is due). Requests ride in the round's reports, so every rank sees every
    rank's request in the same round and all act at the same boundary without an exchange of their own."""

    stop_signal: int = 0
    checkpoint: bool = False


@dataclass
class WorkerRound:
    """One worker's round. ``out``: it hit a non-finite value and sat out the rest of the round (every method
    but DDP), so it contributes nothing to the round's exchange. ``request``: its rank's request of the boundary."""

    steps: list[StepRecord] = field(default_factory=list)
    statistics: GradientStatistics | None = None
    b_max: int = 0
    out: bool = False
    request: BoundaryRequest = BoundaryRequest()
    step_seconds: float = math.nan  # this worker's mean compute time per inner step in the round
    overhead_seconds: float = math.nan  # its rank's previous round: wall time not spent computing steps
    between_seconds: float = math.nan  # its rank's time between rounds (evaluation, records) before that round

    @property
    def failed(self) -> bool:
        return any(not s.finite for s in self.steps)

    @property
    def absent(self) -> bool:
        """Missing from the round's exchange (a fault-tolerant replica that died): it read and sent nothing."""
        return self.b_max == ABSENT_B_MAX

    def to_tensor(self) -> torch.Tensor:
        """A flat float64 vector (exact for every field) that rides in the round's exchange."""
        stats = self.statistics
        head = [float(self.out), float(self.b_max), float(self.request.stop_signal), float(self.request.checkpoint)]
        head += [self.step_seconds, self.overhead_seconds, self.between_seconds]
        head += [
            math.nan if stats is None or getattr(stats, f) is None else float(getattr(stats, f)) for f in _STAT_FIELDS
        ]
        body = [x for s in self.steps for x in (s.loss, float(s.tokens), float(s.finite))]
        return torch.tensor(head + body, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> WorkerRound:
        values = packed.tolist()
        if len(values) < _HEAD or (len(values) - _HEAD) % _PER_STEP:
            raise ValueError(f"a worker's round report has {len(values)} values, which no report layout has")
        stats = dict(zip(_STAT_FIELDS, values[_FLAGS:_HEAD], strict=True))
        statistics = None
        if not math.isnan(stats["samples"]):
            statistics = GradientStatistics(
                samples=int(stats.pop("samples")), **{k: None if math.isnan(v) else v for k, v in stats.items()}
            )
        steps = [
            StepRecord(loss=values[i], tokens=int(values[i + 1]), finite=bool(values[i + 2]))
            for i in range(_HEAD, len(values), _PER_STEP)
        ]
        request = BoundaryRequest(stop_signal=int(values[2]), checkpoint=bool(values[3]))
        return cls(
            steps=steps,
            statistics=statistics,
            b_max=int(values[1]),
            out=bool(values[0]),
            request=request,
            step_seconds=values[4],
            overhead_seconds=values[5],
            between_seconds=values[6],
        )

    def merge_step(self, step: WorkerRound) -> None:
        """Append a one-step report (DDP learns every worker's step as it happens)."""
        self.steps.extend(step.steps)
        self.statistics = self.statistics or step.statistics
        self.b_max = step.b_max
        self.request = joined([self.request, step.request])
        self.step_seconds, self.overhead_seconds = step.step_seconds, step.overhead_seconds
        self.between_seconds = step.between_seconds


@dataclass
class RoundState:
    """One round in progress on this rank: what its hosted workers did (``local``) and, once the round's
    exchanges are done, what every worker of every trainer did (``reports``)."""

    index: int
    steps: int
    first_step: int
    statistics_due: bool
    sync_every: int = 0  # the round's H (steps may be fewer in a last round cut short); 0: the strategy's own
    local: dict[int, WorkerRound] = field(default_factory=dict)
    reports: dict[int, WorkerRound] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)
    compute_seconds: defaultdict[int, float] = field(default_factory=lambda: defaultdict(float))
    # Each worker's weight in its trainer's mean Δ (samples over the trainer's mean); 1.0 for equal shares.
    weights: dict[int, float] = field(default_factory=dict)

    @property
    def out(self) -> set[int]:
        """Hosted workers out of the round after a non-finite loss or gradient."""
        return {w for w, r in self.local.items() if r.out}

    def stamp(self, request: BoundaryRequest) -> None:
        """Put this rank's request (as it stands now) on its hosted workers' reports."""
        for record in self.local.values():
            record.request = joined([record.request, request])

    def stamp_seconds(self, overhead_seconds: float, between_seconds: float = math.nan) -> None:
        """Put the round's measured seconds per step, the rank's last overhead and its time between rounds before
        that on the hosted reports."""
        for worker_id, record in self.local.items():
            record.step_seconds = self.compute_seconds[worker_id] / max(self.steps, 1)
            record.overhead_seconds = overhead_seconds
            record.between_seconds = between_seconds

    def boundary_request(self) -> BoundaryRequest:
        """What the ranks asked of this boundary, from every worker's report: the same on every rank."""
        return joined([r.request for r in self.reports.values()])

    def local_tensors(self, worker_ids: list[int]) -> dict[int, torch.Tensor]:
        return {w: self.local[w].to_tensor() for w in worker_ids if w in self.local}

    def learn(self, packed: dict[int, torch.Tensor]) -> None:
        self.reports.update({w: WorkerRound.from_tensor(t) for w, t in packed.items()})


def absent_report(values: int) -> torch.Tensor:
    """The report of a worker missing from the round (its replica gone), as long as the present workers' (``values``
    floats): out, every step skipped."""
    steps = [SKIPPED_STEP] * ((values - _HEAD) // _PER_STEP)
    return WorkerRound(steps=steps, out=True, b_max=ABSENT_B_MAX).to_tensor()


def joined(requests: list[BoundaryRequest]) -> BoundaryRequest:
    """Requests taken together: a stop if any rank asks one (the highest signal number names it, so every rank
    names the same), a checkpoint if any rank's time cadence is due."""
    return BoundaryRequest(
        stop_signal=max((r.stop_signal for r in requests), default=0),
        checkpoint=any(r.checkpoint for r in requests),
    )


def exchange_time(reports: Iterable[WorkerRound]) -> float:
    """The round's exposed exchange seconds: the largest rank overhead less the longest time a rank spent between
    rounds before it (evaluation, records, checkpoints), which its peers spent waiting at the exchange."""
    reports = list(reports)
    overheads = [r.overhead_seconds for r in reports if math.isfinite(r.overhead_seconds)]
    if not overheads:
        return math.nan
    between = max((r.between_seconds for r in reports if math.isfinite(r.between_seconds)), default=0.0)
    return max(min(overheads), max(overheads) - between)
