"""In-process transport: a world of one rank that hosts every worker slot."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from torch.futures import Future

from adloco.algorithms.outer import sum_in_order
from adloco.comm.base import CommStats, payload_bytes


class LocalCommunicator:
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
        self.stats.bytes_sent += sum(payload_bytes(c) for c in ordered)
        return ordered

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        future: Future[list[list[torch.Tensor]]] = Future()
        future.set_result([list(c) for c in self._ordered(contributions, workers)])
        return future

    def mean_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[torch.Tensor]]:
        start = time.perf_counter()
        ordered = self._ordered(contributions, workers)
        total = sum_in_order(ordered)
        mean = [t.div_(len(ordered)) for t in total]
        self.stats.seconds += time.perf_counter() - start
        future: Future[list[torch.Tensor]] = Future()
        future.set_result(mean)
        return future

    def mean_scalars(self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int]) -> list[float]:
        ordered = [contributions[w] for w in sorted(workers)]
        self.stats.bytes_sent += sum(8 * len(c) for c in ordered)
        return [sum(column) / len(ordered) for column in zip(*ordered, strict=True)]
