"""The Communicator protocol: collectives over a trainer's workers, with byte and time accounting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.futures import Future


@dataclass
class CommStats:
    """Running totals since the last ``take()``.

    ``bytes_sent``: the payloads the workers contribute (each worker's tensors once): what a network with
    one worker per machine would carry, the same in-process and under torchrun (nothing for a lone worker).
    ``wire_bytes``: what this rank actually handed to the backend. ``seconds``: time spent in collectives on this rank.
    """

    bytes_sent: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0

    def take(self) -> CommStats:
        taken = CommStats(self.bytes_sent, self.wire_bytes, self.seconds)
        self.bytes_sent, self.wire_bytes, self.seconds = 0, 0, 0.0
        return taken


class ScalarMeans:
    """``mean_scalars`` for any transport that implements ``gather_worker_scalars``."""

    def mean_scalars(self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int]) -> list[float]:
        values = self.gather_worker_scalars(contributions, workers)  # type: ignore[attr-defined]
        ordered = [values[w] for w in sorted(workers)]
        return [sum(column) / len(ordered) for column in zip(*ordered, strict=True)]


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def contributed_bytes(contributions: Sequence[Sequence[torch.Tensor]], workers: Sequence[int]) -> int:
    """Bytes that ``contributions`` put on a network among ``workers``: none when a worker is alone."""
    return 0 if len(workers) < 2 else sum(payload_bytes(c) for c in contributions)


class Communicator(Protocol):
    """Combines per-worker contributions across the workers of one trainer.

    Contributions are keyed by global worker id; a rank passes only the workers it hosts. Results are
    summed in worker-id order so the numbers do not depend on how workers are placed on ranks.
    """

    rank: int
    world_size: int
    stats: CommStats

    def mean_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int], divisor: int | None = None
    ) -> Future[list[torch.Tensor]]:
        """Start averaging tensor lists over ``workers`` (sum / ``divisor``, default the worker count).

        A worker left out of a mean contributes zeros: adding an exact zero changes no bit of a sum.
        """
        ...

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        """Start gathering every worker's tensor list; the future holds them in worker-id order."""
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

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def gather_objects(self, obj: Any) -> list[Any] | None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...

    def mean_scalars(self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int]) -> list[float]:
        """Average small vectors of scalars over ``workers`` (batch-test statistics, losses)."""
        ...
