"""In-process transport: a world of one rank that hosts every worker slot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.futures import Future

from adloco.comm.base import CommStats, ExchangeMixin, OneProcessOps, contributed_bytes


class LocalCommunicator(OneProcessOps, ExchangeMixin):
    """Every worker lives in this process; collectives are ordered lists, counted as if sent.

    Bytes and exchanges are what a network with one worker per machine would carry, so in-process runs
    report the same figures as torchrun runs of the same layout.
    """

    rank = 0
    world_size = 1
    shards, shard = 1, 0  # a worker spans one process here

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
        self.stats.exchanges += len(workers) > 1
        return ordered

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        future: Future[list[list[torch.Tensor]]] = Future()
        future.set_result([list(c) for c in self._ordered(contributions, workers)])
        return future

    def gather_worker_scalars(
        self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int] | None = None
    ) -> dict[int, list[float]]:
        workers = sorted(contributions) if workers is None else sorted(workers)
        self.stats.bytes_sent += 0 if len(workers) < 2 else sum(8 * len(contributions[w]) for w in workers)
        self.stats.exchanges += len(workers) > 1
        return {w: list(contributions[w]) for w in workers}

    def ranks_of(self, workers: Sequence[int]) -> list[int]:
        return [0]

    def close(self) -> None:
        pass
