"""A cluster's checkpoint state, composed from its parts' own: trainers, workers (inner state and stream), the
sync strategy's exchanges in flight and per-worker state, the b_max table and the cost model; and what an elastic
resume with another worker count changes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from adloco.checkpoint import CheckpointError
from adloco.data.sampling import WindowCursor, cursor_end, regrouped
from adloco.data.token_files import names_token_files

if TYPE_CHECKING:
    from adloco.algorithms.sync_every import AutoSyncEvery
    from adloco.batch.pace import CostModel
    from adloco.comm.base import Communicator
    from adloco.config import TrainConfig
    from adloco.sync.base import SyncStrategy
    from adloco.sync.trainer import Trainer
    from adloco.workers.worker import Worker

log = logging.getLogger(__name__)


class _Batches(Protocol):
    auto: AutoSyncEvery | None


class Cluster(Protocol):
    """The parts of a rank's cluster (``adloco.cluster.cluster.Cluster``) whose state a checkpoint holds; an
    elastic resume sets ``retired_streams`` and ``resized``."""

    config: TrainConfig
    comm: Communicator
    trainers: dict[int, Trainer]
    workers: dict[int, Worker]
    sync: SyncStrategy
    b_max: dict[int, int]
    costs: CostModel | None
    batches: _Batches
    retired_streams: dict[int, dict]
    resized: tuple[int, int] | None


def state_dict(cluster: Cluster) -> dict | None:
    """The whole cluster's state on rank 0 (None on other ranks); every rank must call it."""
    gathered = cluster.comm.gather_objects({w: _worker_state(cluster, w) for w in cluster.workers})
    if gathered is None:
        return None
    return {**shared_state(cluster), "workers": {w: state for part in gathered for w, state in part.items()}}


def local_state_dict(cluster: Cluster) -> dict:
    """What this rank writes of a sharded checkpoint: its workers (its shard of them), and on the first rank of
    each shard the shared state (that shard's rows of it) too."""
    workers = {w: _worker_state(cluster, w) for w in cluster.workers}
    return {
        **(shared_state(cluster) if cluster.comm.rank == 0 else {}),
        "workers": workers,
        "shard": cluster.comm.shard,
    }


def shared_state(cluster: Cluster) -> dict:
    """Trainers, exchanges in flight and costs: the same on every rank after a round, saved once. Every key is
    written (None where the run has no such part), as ``adloco.checkpoint.schema`` has a train run's state."""
    return {
        "trainers": {k: t.state_dict() for k, t in cluster.trainers.items()},
        "b_max": dict(cluster.b_max),  # every worker's, so a rank that reads only its own workers knows them all
        "pending": cluster.sync.state_dict(),
        "costs": None if cluster.costs is None else cluster.costs.state_dict(),
        "sync_every": None if cluster.batches.auto is None else cluster.batches.auto.state_dict(),
        "retired_streams": dict(cluster.retired_streams),
    }


def _worker_state(cluster: Cluster, worker_id: int) -> dict:
    inner = cluster.workers[worker_id].state_dict(with_params=cluster.sync.saves_worker_params)
    return {**inner, "b_max": cluster.b_max[worker_id], **cluster.sync.worker_state(worker_id)}


def load_state_dict(cluster: Cluster, state: dict) -> None:
    """The cluster's state from a checkpoint's (``adloco.checkpoint.load_checkpoint``'s: in this format version)."""
    saved_trainers = state["trainers"]
    for k in list(cluster.trainers):
        if k not in saved_trainers:
            del cluster.trainers[k]
    for k, trainer_state in saved_trainers.items():
        cluster.trainers[k].load_state_dict(trainer_state)
    saved = {int(w): s for w, s in state["workers"].items()}  # this rank's workers, maybe all of them
    saved_ids = sorted({int(w) for t in saved_trainers.values() for w in t["worker_ids"]})
    cluster.retired_streams = {int(w): s for w, s in state["retired_streams"].items()}
    if saved_ids != list(range(cluster.config.total_workers)):
        _resize(cluster, saved, saved_ids)
    for trainer in cluster.trainers.values():
        cluster.comm.register_group(trainer.worker_ids)
        trainer.broadcast(cluster.workers)
    for w, worker in cluster.workers.items():
        if w in saved:
            worker.load_state_dict(saved[w])  # streaming: its own parameters replace θ
            cluster.sync.load_worker_state(w, saved[w])
    cluster.b_max.update({int(w): int(b) for w, b in state["b_max"].items() if int(w) in cluster.b_max})
    cluster.sync.load_state_dict(state["pending"])
    if cluster.costs is not None and state["costs"] is not None:  # None: saved before the cost model, which
        cluster.costs.load_state_dict(state["costs"])  # then starts from this start's own measurement
    if cluster.batches.auto is not None:  # sync_every cannot change on resume: an auto run saved its rule's state
        cluster.batches.auto.load_state_dict(state["sync_every"])


def _resize(cluster: Cluster, saved: dict[int, dict], saved_ids: list[int]) -> None:
    """An elastic resume with another worker count: the highest worker ids retire (their data streams are kept
    for their return), new ids join the trainer with the fewest workers from θ with fresh inner state.
    ``saved`` holds the retiring workers' states (every rank reads them) and this rank's."""
    if not cluster.config.elastic:
        raise CheckpointError(
            f"the checkpoint has {len(saved_ids)} workers, this run {cluster.config.total_workers}; set "
            "elastic=true to let the worker count change"
        )
    current = set(range(cluster.config.total_workers))
    if names_token_files(cluster.config.data.dataset):
        _regroup_cursors(cluster, saved)
    else:
        for w in sorted(set(saved_ids) - current):
            cluster.retired_streams[w] = saved[w]["stream"]
    for trainer in cluster.trainers.values():
        trainer.worker_ids = [w for w in trainer.worker_ids if w in current]
    joined = sorted(current - set(saved_ids))
    for w in joined:
        smallest = min(cluster.trainers.values(), key=lambda t: (len(t.worker_ids), t.trainer_id))
        smallest.worker_ids = sorted([*smallest.worker_ids, w])
        stream = cluster.retired_streams.pop(w, None)
        if stream is not None and w in cluster.workers:
            cluster.workers[w].stream.load_state_dict(stream)  # a returning worker reads on where it stopped
    log.info(
        "elastic: %d workers in the checkpoint, %d now (retired %s, joined %s)",
        len(saved_ids),
        len(current),
        sorted(set(saved_ids) - current) or "none",
        joined or "none",
    )
    cluster.resized = (len(saved_ids), len(current))


def _regroup_cursors(cluster: Cluster, saved: dict[int, dict]) -> None:
    """Token files: every worker of the new count reads on from the first position past all the saved workers'
    reads (``adloco.data.sampling.regrouped``); no stream is kept for a retired worker, none is needed."""
    windows = next(iter(cluster.workers.values())).stream.cursor.order.n
    for state in saved.values():  # the files' window count, as a cursor's own load would check it
        WindowCursor(windows, 0, 0, 1).load_state_dict(state["stream"])
    ends = {w: cursor_end(state["stream"]) for w, state in saved.items()}
    if cluster.comm.world_size > 1:  # a rank holds its own workers' states and the retiring ones': pool them
        gathered = cluster.comm.gather_objects(ends)
        pooled = None if gathered is None else {w: end for part in gathered for w, end in part.items()}
        ends = cluster.comm.broadcast_object(pooled)
    cursors = regrouped(ends, windows, cluster.config.total_workers)
    for w, worker in cluster.workers.items():
        if w in saved:
            saved[w]["stream"] = cursors[w]
        else:
            worker.stream.load_state_dict(cursors[w])
    log.info("elastic: token files read on from position %d with %d workers", cursors[0]["base"],
             cluster.config.total_workers)  # fmt: skip
