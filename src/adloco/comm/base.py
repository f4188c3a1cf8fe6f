"""The Communicator protocol: collectives over a trainer's workers, with byte, time and exchange accounting."""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.futures import Future

from adloco.algorithms.outer import sum_in_order


@dataclass
class CommStats:
    """Running totals since the last ``take()``.

    ``bytes_sent``: the payloads the workers contribute (each worker's tensors once): what a network with
    one worker per machine would carry, the same in-process and under torchrun (nothing for a lone worker).
    ``wire_bytes``: what this rank actually handed to the backend. ``seconds``: time from the start of each
    collective to its completion on this rank (it may overlap compute). ``exchanges``: collectives among two
    or more workers that this rank took part in. ``wait_seconds``: time this rank sat blocked in them.
    """

    bytes_sent: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    exchanges: int = 0
    wait_seconds: float = 0.0

    def take(self) -> CommStats:
        taken = CommStats(self.bytes_sent, self.wire_bytes, self.seconds, self.exchanges, self.wait_seconds)
        self.bytes_sent, self.wire_bytes, self.seconds, self.exchanges, self.wait_seconds = 0, 0, 0.0, 0, 0.0
        return taken


@dataclass
class Gathered:
    """What an exchange brings back, on every rank of the group: every worker's tensors in worker-id order
    (``rows``) or their sum in that order (``total``), and every worker's float64 report vector. ``absent``:
    workers missing from the exchange (a fault-tolerant transport's dead replicas): zero rows and no report."""

    rows: list[list[torch.Tensor]] | None
    total: list[torch.Tensor] | None
    reports: dict[int, torch.Tensor]
    absent: frozenset[int] = frozenset()
    report_width: int = 0  # floats in each worker's report (where this rank sent none to learn it from)

    def reports_with_absent(self, absent_row: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every worker's report, ``absent_row`` standing in for each absent worker's (which sent none)."""
        return {**self.reports, **dict.fromkeys(self.absent, absent_row)}


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def contributed_bytes(contributions: Sequence[Sequence[torch.Tensor]], workers: Sequence[int]) -> int:
    """Bytes that ``contributions`` put on a network among ``workers``: none when a worker is alone."""
    return 0 if len(workers) < 2 else sum(payload_bytes(c) for c in contributions)


def pack_report(report: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 report reinterpreted (not converted) as ``dtype``, so it rides in a payload row bit for bit."""
    if report.dtype != torch.float64 or report.dim() != 1:
        raise ValueError("a report is a 1-D float64 tensor")
    return report.contiguous().view(dtype)


def unpack_report(packed: torch.Tensor) -> torch.Tensor:
    return packed.clone().view(torch.float64)  # a fresh buffer: a slice of a row may start mid-float64


class ExchangeMixin:
    """Round exchanges for any transport with ``gather_over_workers``: reports travel in the same collective as
    the payload (one round trip, not two), and blocking waits are timed."""

    stats: CommStats

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        raise NotImplementedError

    def absent_from_last(self) -> frozenset[int]:
        """Workers missing from the exchange that just completed (a transport whose members come and go)."""
        return frozenset()

    def wait(self, future: Future) -> Any:
        """Block until ``future`` is done, counting the time as waiting for peers."""
        start = time.perf_counter()
        try:
            return future.wait()
        finally:
            self.stats.wait_seconds += time.perf_counter() - start

    def gather_with_reports(
        self,
        contributions: Mapping[int, Sequence[torch.Tensor]],
        reports: Mapping[int, torch.Tensor] | None,
        workers: Sequence[int],
    ) -> Future[Gathered]:
        """One collective: every worker's tensors (all of one dtype) and its report (if any), in worker-id order."""
        packed: dict[int, list[torch.Tensor]] = {}
        for w, tensors in contributions.items():
            dtype = tensors[0].dtype if tensors else torch.float64
            device = tensors[0].device if tensors else torch.device("cpu")  # one row, one device (a GPU model's)
            packed[w] = [*tensors] + ([] if reports is None else [pack_report(reports[w], dtype).to(device)])
        ordered = sorted(workers)
        # the callback may run on a backend's thread, which may release it last: a weak reference, so that it never
        # holds this object's group handles (whose destructor would join that very thread)
        transport = weakref.ref(self)

        def unpack(done: Future) -> Gathered:
            rows = done.wait()
            holder = transport()
            absent = frozenset() if holder is None else holder.absent_from_last()
            if reports is None:
                return Gathered(rows=rows, total=None, reports={}, absent=absent)
            reports_by_worker = {
                w: unpack_report(row[-1]) for w, row in zip(ordered, rows, strict=True) if w not in absent
            }
            width = rows[0][-1].numel() * rows[0][-1].element_size() // 8 if rows else 0  # an absent row's too
            return Gathered([row[:-1] for row in rows], None, reports_by_worker, absent, width)

        return self.gather_over_workers(packed, ordered).then(unpack)

    def sum_with_reports(
        self,
        contributions: Mapping[int, Sequence[torch.Tensor]],
        reports: Mapping[int, torch.Tensor] | None,
        workers: Sequence[int],
    ) -> Future[Gathered]:
        """Like ``gather_with_reports``, with the tensors summed in worker-id order (whatever the placement)."""

        def add_up(done: Future) -> Gathered:
            gathered = done.wait()
            assert gathered.rows is not None
            return Gathered(None, sum_in_order(gathered.rows), gathered.reports, gathered.absent, gathered.report_width)

        return self.gather_with_reports(contributions, reports, workers).then(add_up)


class OneProcessOps:
    """The collectives that have nothing to do where the only rank of every group is this process (the in-process
    world, or a fault-tolerant replica of one worker): placement, broadcasts, shards, barriers."""

    def set_placement(self, worker_rank: Mapping[int, int]) -> None:
        pass

    def register_group(self, workers: Sequence[int]) -> None:
        pass

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather_objects(self, obj: Any) -> list[Any] | None:
        return [obj]

    def gather_floats(self, values: Sequence[float]) -> Future[list[list[float]]]:
        done: Future = Future()
        done.set_result([list(values)])
        return done

    def sum_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def max_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def gather_shards(self, tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return list(tensors)

    def barrier(self) -> None:
        pass


class Communicator(Protocol):
    """Combines per-worker contributions across the workers of one trainer.

    Contributions are keyed by global worker id; a rank passes only the workers it hosts. Results are
    summed in worker-id order so the numbers do not depend on how workers are placed on ranks.
    """

    rank: int
    world_size: int
    shards: int  # ranks per worker; ``rank`` and ``world_size`` count the ranks that hold one shard
    shard: int  # the shard this rank holds of each of its workers
    stats: CommStats

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        """Start gathering every worker's tensor list; the future holds them in worker-id order."""
        ...

    def gather_with_reports(
        self,
        contributions: Mapping[int, Sequence[torch.Tensor]],
        reports: Mapping[int, torch.Tensor] | None,
        workers: Sequence[int],
    ) -> Future[Gathered]:
        """Start gathering every worker's tensors together with its float64 report vector (if any)."""
        ...

    def sum_with_reports(
        self,
        contributions: Mapping[int, Sequence[torch.Tensor]],
        reports: Mapping[int, torch.Tensor] | None,
        workers: Sequence[int],
    ) -> Future[Gathered]:
        """Start summing every worker's tensors in worker-id order, and gathering the reports (if any).

        A worker left out of a mean contributes zeros: adding an exact zero changes no bit of a sum.
        """
        ...

    def wait(self, future: Future) -> Any:
        """Block until ``future`` is done; the time counts as ``stats.wait_seconds``."""
        ...

    def gather_worker_scalars(
        self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int] | None = None
    ) -> dict[int, list[float]]:
        """Every listed worker's small vector of floats (default: all workers), on every rank."""
        ...

    def set_placement(self, worker_rank: Mapping[int, int]) -> None: ...

    def register_group(self, workers: Sequence[int]) -> None:
        """Create the group of ranks hosting ``workers``; every rank calls it in the same order."""
        ...

    def ranks_of(self, workers: Sequence[int]) -> list[int]:
        """The ranks that host ``workers``, sorted."""
        ...

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def gather_objects(self, obj: Any) -> list[Any] | None: ...

    def gather_floats(self, values: Sequence[float]) -> Future[list[list[float]]]:
        """Start gathering every rank's ``values`` (same length on each) to every rank; nothing waits for it now.

        Bookkeeping, not training traffic: it is neither counted among the exchanges nor timed.
        """
        ...

    def sum_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the shards of this rank's workers (itself when workers are not sharded)."""
        ...

    def max_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of ``values`` over the shards of this rank's workers, element by element."""
        ...

    def gather_shards(self, tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Whole tensors of ``shapes`` from their shards, where rank 0 needs them (``tensors`` elsewhere)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...
