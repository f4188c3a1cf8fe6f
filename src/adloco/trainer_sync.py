"""Trainers across ranks and into one another: each trainer's state mirrored from its lead rank where some rank
hosts none of its workers, and merging the trainers with the smallest b_req (AdLoCo's merge)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adloco.algorithms.merge import merge_weights, merged_batch_size, select_merge_group, weighted_average

if TYPE_CHECKING:
    from adloco.cluster import Cluster
    from adloco.sync import RoundState

log = logging.getLogger("adloco.cluster")


@dataclass
class MergeEvent:
    round: int
    merged: list[int]
    into: int
    weights: list[float]
    batch_size: int
    workers: list[int]

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def synchronize(cluster: Cluster, state: RoundState | None = None) -> None:
    """Give every rank every trainer's state (and its workers' round reports), from the trainer's lead rank.

    Only needed when some rank hosts none of a trainer's workers (several trainers on several ranks):
    merges, evaluation, checkpoints and the token count then agree everywhere.
    """
    if cluster.comm.world_size == 1 or all(
        set(cluster.comm.ranks_of(t.worker_ids)) == set(range(cluster.comm.world_size))
        for t in cluster.trainers.values()
    ):
        return
    for trainer in cluster.trainers.values():
        src = cluster.lead_rank(trainer)
        meta = None
        if cluster.comm.rank == src:
            meta = trainer.sync_metadata()
            if state is not None:
                meta["reports"] = {w: state.reports[w].to_tensor() for w in trainer.worker_ids}
        meta = cluster.comm.broadcast_object(meta, src=src)
        if cluster.comm.rank != src:
            trainer.load_sync_metadata(meta)
            if state is not None:
                state.learn(meta["reports"])
        cluster.comm.broadcast_tensors(trainer.theta, src)
        buffers = trainer.momentum_buffers()
        if meta["has_momentum"]:
            if any(b is None for b in buffers):
                trainer.set_momentum_buffers([torch.zeros_like(t) for t in trainer.theta])
                buffers = trainer.momentum_buffers()
            cluster.comm.broadcast_tensors(buffers, src)


def maybe_merge(cluster: Cluster, round_index: int) -> MergeEvent | None:
    """Every ``merge.every`` rounds, merge the trainers with the smallest b_req into the first of them."""
    merge = cluster.config.merge
    if merge.policy == "off" or len(cluster.trainers) < 2 or (round_index + 1) % merge.every != 0:
        return None
    b_req = {k: t.batch_size for k, t in cluster.trainers.items()}
    group = select_merge_group(b_req, min(merge.group_size, len(cluster.trainers)))
    members = [cluster.trainers[k] for k in group]
    weights = merge_weights(merge.policy, [t.batch_size for t in members], [len(t.worker_ids) for t in members])
    theta = weighted_average([t.theta for t in members], weights)
    momentum = weighted_average([t.momentum_buffers() for t in members], weights)
    survivor = members[0]
    with torch.no_grad():
        for target, value in zip(survivor.theta, theta, strict=True):
            target.copy_(value)
    if survivor.momentum > 0:
        survivor.set_momentum_buffers(momentum)
    survivor.batch_size = merged_batch_size([t.batch_size for t in members])
    for other in members[1:]:
        survivor.worker_ids = sorted(survivor.worker_ids + other.worker_ids)
        del cluster.trainers[other.trainer_id]
    survivor.broadcast(cluster.workers)
    cluster.comm.register_group(survivor.worker_ids)
    event = MergeEvent(
        round=round_index + 1,
        merged=group,
        into=survivor.trainer_id,
        weights=list(weights),
        batch_size=survivor.batch_size,
        workers=list(survivor.worker_ids),
    )
    log.info("merge: trainers %s into %d with weights %s", group, survivor.trainer_id, weights)
    return event
