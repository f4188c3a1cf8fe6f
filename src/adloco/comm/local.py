"""In-process transport: a world of one rank that hosts every worker slot."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.futures import Future

from adloco.algorithms.outer import sum_in_order
from adloco.comm.base import CommStats, ScalarMeans, contributed_bytes


class LocalCommunicator(ScalarMeans):
    """Every worker lives in this process; collectives are ordered sums, counted as if sent."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def _ordered(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> list[Sequence[torch.Tensor]]:
        missing = [w for w in workers if w not in contributions]
        if missing:
            raise RuntimeError(f"workers {missing} are not hosted by the only rank")
        ordered = [contributions[w] for w in sorted(workers)]
        self.stats.bytes_sent += contributed_bytes(ordered, workers)
        return ordered

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        future: Future[list[list[torch.Tensor]]] = Future()
        future.set_result([list(c) for c in self._ordered(contributions, workers)])
        return future

    def mean_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int], divisor: int | None = None
    ) -> Future[list[torch.Tensor]]:
        start = time.perf_counter()
        ordered = self._ordered(contributions, workers)
        total = sum_in_order(ordered)
        mean = [t.div_(divisor or len(ordered)) for t in total]
        self.stats.seconds += time.perf_counter() - start
        future: Future[list[torch.Tensor]] = Future()
        future.set_result(mean)
        return future

    def gather_worker_scalars(
        self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int] | None = None
    ) -> dict[int, list[float]]:
        workers = sorted(contributions) if workers is None else sorted(workers)
        self.stats.bytes_sent += 0 if len(workers) < 2 else sum(8 * len(contributions[w]) for w in workers)
        return {w: list(contributions[w]) for w in workers}

    # A world of one rank: placement, groups and broadcasts have nothing to do.
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

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
