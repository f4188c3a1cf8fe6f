"""Transport over torch.distributed (gloo on CPU, NCCL on GPU), one process group per trainer."""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from adloco.algorithms.flat import flatten, unflatten
from adloco.algorithms.outer import sum_in_order
from adloco.comm.base import CommStats, ExchangeMixin, Gathered, contributed_bytes

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def launched_by_torchrun() -> bool:
    """True under torchrun, or when RANK and WORLD_SIZE are set by hand."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _int_env(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


def restart_attempt() -> int:
    """How often torchrun has restarted this job's workers so far (0: the first attempt, or no torchrun)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT")


def max_restarts() -> int:
    """torchrun's ``--max-restarts`` for this job (0 without torchrun)."""
    return _int_env("TORCHELASTIC_MAX_RESTARTS")


def job_key() -> str | None:
    """A file-name-safe name of this torchrun job that every attempt of the job shares; None without torchrun.

    torchrun keeps ``TORCHELASTIC_RUN_ID`` across restarts (``--rdzv-id``; a fresh UUID with ``--standalone``).
    Its default is the literal ``none``; master address and port, also fixed for the job, tell such jobs apart.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id in ("", "none"):
        run_id = f"none_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` over torchrun's store, with this attempt's keys kept apart from earlier attempts'.

    torchrun's agent hosts one TCPStore for the whole job and hands the same one to every restarted attempt
    (``TORCHELASTIC_USE_AGENT_STORE``). Its keys outlive the workers that wrote them: a restarted rank would
    read a dead rank's gloo address from the first attempt and fail with "connection refused". A prefix per
    attempt gives every attempt a clean namespace (subgroups too, as they share the default group's store).
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(f"adloco/attempt_{restart_attempt()}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class DistributedCommunicator(ExchangeMixin):
    """Collectives among the ranks that host a trainer's workers.

    ``reduce="gather"`` (default) all-gathers every worker's contribution and sums them in worker-id order:
    the result does not depend on how workers are placed on ranks, so N ranks × 1 slot and 1 rank × N slots
    give the same bits; the workers' reports ride in the same collective. ``reduce="allreduce"`` sums a
    rank's own slots first and all-reduces the partial sums: less traffic (2|θ| instead of M|θ| received),
    but the floating-point order follows the backend, and the reports need a second (small) collective.
    """

    def __init__(self, backend: str = "auto", timeout_s: float = 300.0, reduce: str = "gather") -> None:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            # gloo otherwise listens on the interface the hostname resolves to; keep a loopback job on loopback.
            if os.environ.get("MASTER_ADDR", "127.0.0.1") in _LOOPBACK:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            _init_process_group(backend, timedelta(seconds=timeout_s))
        self.backend = backend
        self.reduce = reduce
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.stats = CommStats()
        self.placement: dict[int, int] = {}
        self._groups: dict[frozenset[int], Any] = {}

    # -- placement and groups -------------------------------------------------------------------------
    def set_placement(self, worker_rank: Mapping[int, int]) -> None:
        self.placement = dict(worker_rank)
        if set(self.placement.values()) != set(range(self.world_size)):
            raise ValueError("every rank must host at least one worker slot")
        self._groups[frozenset(self.placement)] = dist.group.WORLD

    def ranks_of(self, workers: Sequence[int]) -> list[int]:
        return sorted({self.placement[w] for w in workers})

    def register_group(self, workers: Sequence[int]) -> None:
        """Create the process group of ``workers``' ranks. Every rank calls this, in the same order."""
        key = frozenset(workers)
        ranks = self.ranks_of(workers)
        if key in self._groups:
            return
        if len(ranks) == self.world_size:
            self._groups[key] = dist.group.WORLD
        else:
            group = dist.new_group(ranks)  # collective over the world, members or not
            self._groups[key] = group

    def _group(self, workers: Sequence[int]):
        return self._groups[frozenset(workers)]

    # -- tensor collectives -----------------------------------------------------------------------------
    def _timed(self, start: float, sent: int, payload: int) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.wire_bytes += sent
        self.stats.bytes_sent += payload

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        start = time.perf_counter()
        ordered = sorted(workers)
        like = next(iter(contributions.values()))
        ranks = self.ranks_of(ordered)
        hosted_by = {r: [w for w in ordered if self.placement[w] == r] for r in ranks}
        rows = max(len(v) for v in hosted_by.values())
        numel = sum(t.numel() for t in like)
        local = torch.zeros(rows, numel, dtype=like[0].dtype, device=self.device)
        for row, worker in enumerate(hosted_by[self.rank]):
            local[row] = flatten(contributions[worker]).to(self.device)
        outputs = [torch.empty_like(local) for _ in ranks]
        payload = contributed_bytes([contributions[w] for w in hosted_by[self.rank]], ordered)
        if len(ranks) == 1:
            outputs[0].copy_(local)
            future: Future = Future()
            future.set_result(outputs)
            sent = 0
        else:
            work = dist.all_gather(outputs, local, group=self._group(ordered), async_op=True)
            future = work.get_future()
            sent = local.numel() * local.element_size()
        self.stats.exchanges += len(ordered) > 1

        def unpack(done: Future) -> list[list[torch.Tensor]]:
            # A callback runs even when the collective failed (a peer died); wait() raises that error here
            # instead of handing on the uninitialised output buffers as if they were the peers' values.
            done.wait()
            by_worker = {}
            for rank, gathered in zip(ranks, outputs, strict=True):
                for row, worker in enumerate(hosted_by[rank]):
                    by_worker[worker] = [t.clone() for t in unflatten(gathered[row].cpu(), like)]
            self._timed(start, sent, payload)
            return [by_worker[w] for w in ordered]

        return future.then(unpack)

    def sum_with_reports(
        self,
        contributions: Mapping[int, Sequence[torch.Tensor]],
        reports: Mapping[int, torch.Tensor] | None,
        workers: Sequence[int],
    ) -> Future[Gathered]:
        if self.reduce != "allreduce":
            return super().sum_with_reports(contributions, reports, workers)
        summed = self._allreduce_sum(contributions, workers)
        if reports is None:
            return summed.then(lambda done: Gathered(rows=None, total=done.wait(), reports={}))
        # Both collectives start now and are waited on together: still one wait per exchange.
        gathered = self.gather_over_workers({w: [r] for w, r in reports.items()}, workers)
        ordered = sorted(workers)

        def combine(done: Future) -> Gathered:
            total, rows = (f.wait() for f in done.wait())
            return Gathered(rows=None, total=total, reports={w: r[0] for w, r in zip(ordered, rows, strict=True)})

        return torch.futures.collect_all([summed, gathered]).then(combine)

    def _allreduce_sum(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[torch.Tensor]]:
        start = time.perf_counter()
        ordered = sorted(workers)
        mine = [contributions[w] for w in ordered if self.placement[w] == self.rank]
        like = mine[0]
        flat = flatten(sum_in_order(mine)).to(self.device)
        payload = contributed_bytes(mine, ordered)
        if len(self.ranks_of(ordered)) == 1:
            future: Future = Future()
            future.set_result(None)
            sent = 0
        else:
            future = dist.all_reduce(flat, group=self._group(ordered), async_op=True).get_future()
            sent = 2 * flat.numel() * flat.element_size()
        self.stats.exchanges += len(ordered) > 1

        def finish(done: Future) -> list[torch.Tensor]:
            done.wait()  # re-raise a failed all-reduce rather than return a half-reduced buffer
            self._timed(start, sent, payload)
            return [t.clone() for t in unflatten(flat.cpu(), like)]

        return future.then(finish)

    def gather_worker_scalars(
        self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int] | None = None
    ) -> dict[int, list[float]]:
        """Every listed worker's small vector of floats, on every rank of their group (float64, exact)."""
        workers = sorted(self.placement) if workers is None else sorted(workers)
        width = len(next(iter(contributions.values())))
        tensors = {w: [torch.tensor(list(v), dtype=torch.float64)] for w, v in contributions.items() if w in workers}
        gathered = self.wait(self.gather_over_workers(tensors, workers))
        return {w: [float(x) for x in g[0][:width]] for w, g in zip(workers, gathered, strict=True)}

    # -- whole-world helpers -------------------------------------------------------------------------------
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Overwrite ``tensors`` on every rank with ``src``'s values."""
        if self.world_size == 1 or not tensors:
            return
        start = time.perf_counter()
        flat = flatten(tensors).to(self.device)
        dist.broadcast(flat, src=src)
        with torch.no_grad():
            for t, value in zip(tensors, unflatten(flat.cpu(), tensors), strict=True):
                t.copy_(value)
        self.stats.seconds += time.perf_counter() - start
        self.stats.wait_seconds += time.perf_counter() - start
        self.stats.exchanges += 1
        if self.rank == src:
            self.stats.wire_bytes += flat.numel() * flat.element_size()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        start = time.perf_counter()
        dist.broadcast_object_list(box, src=src)
        self.stats.wait_seconds += time.perf_counter() - start
        self.stats.exchanges += self.world_size > 1
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def gather_floats(self, values: Sequence[float]) -> Future[list[list[float]]]:
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        outputs = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(outputs, mine, async_op=True)
        return work.get_future().then(lambda done: (done.wait(), [o.cpu().tolist() for o in outputs])[1])

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Held group handles would keep gloo's worker threads alive until interpreter teardown, where joining
        # them may abort the process (SIGABRT after a finished run); release them while Python is still whole.
        self._groups.clear()
        gc.collect()
