"""Transport over torch.distributed (gloo on CPU, NCCL on GPU), one process group per trainer."""

from __future__ import annotations

import copy
import gc
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from math import prod
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from adloco.algorithms.flat import flatten, unflatten
from adloco.algorithms.outer import sum_in_order
from adloco.algorithms.sharding import join_shards, shard_shape
from adloco.comm.base import CommStats, ExchangeMixin, Gathered, contributed_bytes
from adloco.comm.launcher import (  # noqa: F401 - their home before, imported from here by callers
    job_key,
    launched_by_torchrun,
    max_restarts,
    restart_attempt,
    world_size_from_env,
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start_process_group(backend: str, timeout_s: float) -> None:
    """The default process group of this torchrun job (a loopback job's gloo kept on loopback)."""
    # gloo otherwise listens on the interface the hostname resolves to
    if os.environ.get("MASTER_ADDR", "127.0.0.1") in _LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _init_process_group(backend, timedelta(seconds=timeout_s))


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
        made = not dist.is_initialized()
        if made:
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            start_process_group(backend, timeout_s)
        else:  # the program's group: its backend and timeout are the program's
            backend = str(dist.get_backend())
        self.backend = backend
        self.reduce = reduce
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.stats = CommStats()
        self.placement: dict[int, int] = {}
        self._groups: dict[frozenset[int], Any] = {}
        # Sharded workers (see shard_view): this rank holds shard ``shard`` of ``shards``; ``rank`` and
        # ``world_size`` then count the ranks that hold that shard, one per worker slot block.
        self.shards, self.shard = 1, 0
        self._world: Any = dist.group.WORLD
        # closing ends the process group it made; one that existed before is the program's to end
        self._owns_world = made
        self.shard_group: Any = None
        self.shard_mesh: Any = None
        self._views: list[DistributedCommunicator] = []

    @classmethod
    def on_group(
        cls, group: Any = None, reduce: str = "gather", device: torch.device | None = None
    ) -> DistributedCommunicator:
        """A communicator over a process group someone else made and owns (a user's loop: the default group, or
        ``group``): its ranks are the group's ranks, and ``close`` leaves the group alone. Exchanges run on
        ``device`` (the model's) where the backend has NCCL and ``device`` is a GPU, else on the CPU."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first (or use torchrun)")
        view = cls.__new__(cls)
        view.backend = str(dist.get_backend(group))
        view.reduce = reduce
        view.rank, view.world_size = dist.get_rank(group), dist.get_world_size(group)
        cuda = "nccl" in view.backend and device is not None and device.type == "cuda"
        view.device = device if cuda else torch.device("cpu")
        view.stats, view.placement, view._groups = CommStats(), {}, {}
        view.shards, view.shard, view.shard_group, view.shard_mesh, view._views = 1, 0, None, None, []
        # None names the default group to every collective: holding the group object itself would keep it alive
        # after the user's destroy_process_group, and its teardown at interpreter exit can abort the process.
        view._world = group
        view._owns_world = False
        return view

    def shard_view(self, shards: int) -> DistributedCommunicator:
        """This communicator among the ranks that hold the same shard of every worker: HSDP's replicate
        dimension of a (ranks / shards) × shards mesh, where rank g holds shard g mod shards of the worker slots
        on row g // shards. Statistics are shared with this communicator. Every rank calls it, in the same order."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_size % shards:
            raise ValueError(f"shards: a world of {self.world_size} ranks is not a multiple of shards={shards}")
        mesh = init_device_mesh(
            self.device.type, (self.world_size // shards, shards), mesh_dim_names=("replicate", "shard")
        )
        view = copy.copy(self)
        view.shards, view.shard = shards, self.rank % shards
        view.rank, view.world_size = self.rank // shards, self.world_size // shards
        view.placement, view._groups = {}, {}
        view._world = mesh.get_group("replicate")
        view.shard_group, view.shard_mesh = mesh.get_group("shard"), mesh["shard"]
        view._views = []
        self._views.append(view)
        return view

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` of this communicator."""
        if self._world is not None and self._world is not dist.group.WORLD and self.shards == 1:  # on_group's own
            return dist.get_global_rank(self._world, rank)
        return rank * self.shards + self.shard

    # -- placement and groups -------------------------------------------------------------------------
    def set_placement(self, worker_rank: Mapping[int, int]) -> None:
        self.placement = dict(worker_rank)
        if set(self.placement.values()) != set(range(self.world_size)):
            raise ValueError("every rank must host at least one worker slot")
        self._groups[frozenset(self.placement)] = self._world

    def ranks_of(self, workers: Sequence[int]) -> list[int]:
        return sorted({self.placement[w] for w in workers})

    def register_group(self, workers: Sequence[int]) -> None:
        """Create the process group of ``workers``' ranks. Every rank calls this, in the same order."""
        key = frozenset(workers)
        ranks = self.ranks_of(workers)
        if key in self._groups:
            return
        if len(ranks) == self.world_size:
            self._groups[key] = self._world
            return
        for shard in range(self.shards):  # new_group is collective over the world, members or not
            group = dist.new_group([r * self.shards + shard for r in ranks])
            if shard == self.shard:
                self._groups[key] = group

    def _group(self, workers: Sequence[int]):
        return self._groups[frozenset(workers)]

    # -- tensor collectives -----------------------------------------------------------------------------
    def _all_gather(self, outputs: list[torch.Tensor], local: torch.Tensor, workers: Sequence[int]) -> Future:
        """Start the all-gather of ``local`` among ``workers``' ranks: every exchange's collective starts here or in
        ``_all_reduce``, so a subclass can keep count of them (a user's loop's, adloco.api)."""
        return dist.all_gather(outputs, local, group=self._group(workers), async_op=True).get_future()

    def _all_reduce(self, flat: torch.Tensor, workers: Sequence[int]) -> Future:
        """Start the all-reduce (sum) of ``flat`` among ``workers``' ranks."""
        return dist.all_reduce(flat, group=self._group(workers), async_op=True).get_future()

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
            future = self._all_gather(outputs, local, ordered)
            sent = local.numel() * local.element_size()
        self.stats.exchanges += len(ordered) > 1
        stats = self.stats  # the callback runs on gloo's thread: it must hold no group handle (not this object)

        def unpack(done: Future) -> list[list[torch.Tensor]]:
            # A callback runs even when the collective failed (a peer died); wait() raises that error here
            # instead of handing on the uninitialised output buffers as if they were the peers' values.
            done.wait()
            by_worker = {}
            for rank, gathered in zip(ranks, outputs, strict=True):
                for row, worker in enumerate(hosted_by[rank]):
                    by_worker[worker] = [t.clone() for t in unflatten(gathered[row].cpu(), like)]
            _timed(stats, start, sent, payload)
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
            future = self._all_reduce(flat, ordered)
            sent = 2 * flat.numel() * flat.element_size()
        self.stats.exchanges += len(ordered) > 1
        stats = self.stats  # the callback runs on gloo's thread: it must hold no group handle (not this object)

        def finish(done: Future) -> list[torch.Tensor]:
            done.wait()  # re-raise a failed all-reduce rather than return a half-reduced buffer
            _timed(stats, start, sent, payload)
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

    # -- within a sharded worker ------------------------------------------------------------------------
    def sum_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the shards of this rank's workers (float64 sums of per-shard partial sums)."""
        if self.shards == 1:
            return values
        summed = values.to(self.device, torch.float64)
        dist.all_reduce(summed, group=self.shard_group)
        return summed.cpu()

    def max_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of ``values`` over the shards of this rank's workers, element by element."""
        if self.shards == 1:
            return values
        largest = values.to(self.device, torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.shard_group)
        return largest.cpu()

    def gather_shards(self, tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The whole tensors of ``shapes`` from every shard's rows of them, on every rank of the first row of the
        mesh (the others get ``tensors`` back: rank 0 is the one that evaluates and exports)."""
        if self.shards == 1 or self.rank != 0:
            return list(tensors)
        mine = flatten(tensors).to(self.device)
        sizes = [sum(prod(shard_shape(s, i, self.shards)) for s in shapes) for i in range(self.shards)]
        padded = torch.zeros(max(sizes), dtype=mine.dtype, device=self.device)
        padded[: mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.shards)]
        dist.all_gather(gathered, padded, group=self.shard_group)
        pieces = []
        for index, flat in enumerate(gathered):
            like = [torch.empty(shard_shape(s, index, self.shards)) for s in shapes]
            pieces.append(unflatten(flat[: sizes[index]].cpu(), like))
        return [join_shards([p[i] for p in pieces]) for i in range(len(shapes))]

    # -- whole-world helpers -------------------------------------------------------------------------------
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Overwrite ``tensors`` on every rank with ``src``'s values."""
        if self.world_size == 1 or not tensors:
            return
        start = time.perf_counter()
        flat = flatten(tensors).to(self.device)
        dist.broadcast(flat, src=self._global(src), group=self._world)
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
        dist.broadcast_object_list(box, src=self._global(src), group=self._world)
        self.stats.wait_seconds += time.perf_counter() - start
        self.stats.exchanges += self.world_size > 1
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._global(0), group=self._world)
        return out

    def gather_floats(self, values: Sequence[float]) -> Future[list[list[float]]]:
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        outputs = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(outputs, mine, group=self._world, async_op=True)
        return work.get_future().then(lambda done: (done.wait(), [o.cpu().tolist() for o in outputs])[1])

    def barrier(self) -> None:
        dist.barrier(group=self._world)

    def close(self) -> None:
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
        # Held group handles would keep gloo's worker threads alive until interpreter teardown, where joining
        # them may abort the process (SIGABRT after a finished run); release them while Python is still whole.
        for holder in [self, *self._views]:
            holder._groups.clear()
            holder._world = holder.shard_group = holder.shard_mesh = None
        self._views.clear()
        gc.collect()


def _timed(stats: CommStats, start: float, sent: int, payload: int) -> None:
    """An exchange's seconds and bytes into ``stats`` (from its completion callback)."""
    stats.seconds += time.perf_counter() - start
    stats.wire_bytes += sent
    stats.bytes_sent += payload
