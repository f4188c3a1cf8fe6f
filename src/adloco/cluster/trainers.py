"""Trainers across ranks and into one another: each trainer's state mirrored from its lead rank where some rank
hosts none of its workers, and merging the trainers with the smallest b_req (AdLoCo's merge)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adloco.algorithms.merge import merge_weights, merged_batch_size, select_merge_group, weighted_average
from adloco.comm.base import Communicator
from adloco.config import MergeConfig
from adloco.sync.trainer import Trainer
from adloco.workers.worker import Worker

if TYPE_CHECKING:
    from adloco.sync import RoundState

log = logging.getLogger(__name__)


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


def synchronize(comm: Communicator, trainers: Mapping[int, Trainer], state: RoundState | None = None) -> None:
    """Give every rank every trainer's state (and its workers' round reports), from the trainer's lead rank (the
    rank of its first worker).

    Only needed when some rank hosts none of a trainer's workers (several trainers on several ranks):
    merges, evaluation, checkpoints and the token count then agree everywhere. Not where every rank steps every
    trainer itself (fault-tolerant replicas: a lead rank may be gone).
    """
    if (
        comm.world_size == 1
        or getattr(comm, "holds_every_trainer", False)
        or all(set(comm.ranks_of(t.worker_ids)) == set(range(comm.world_size)) for t in trainers.values())
    ):
        return
    for trainer in trainers.values():
        src = comm.ranks_of(trainer.worker_ids[:1])[0]
        meta = None
        if comm.rank == src:
            meta = trainer.sync_metadata()
            if state is not None:
                meta["reports"] = {w: state.reports[w].to_tensor() for w in trainer.worker_ids}
        meta = comm.broadcast_object(meta, src=src)
        if comm.rank != src:
            trainer.load_sync_metadata(meta)
            if state is not None:
                state.learn(meta["reports"])
        comm.broadcast_tensors(trainer.theta, src)
        _mirror_outer_state(comm, trainer, src)


def _mirror_outer_state(comm: Communicator, trainer: Trainer, src: int) -> None:
    """The lead rank's outer optimizer state on every rank: its layout and step counts as an object, its
    per-element tensors (momentum, moments) as tensors."""
    tensors, scalars = trainer.outer_state() if comm.rank == src else ({}, {})
    layout = comm.broadcast_object((sorted(tensors), scalars) if comm.rank == src else None, src=src)
    keys, scalars = layout
    if comm.rank == src:
        comm.broadcast_tensors([tensors[k] for k in keys], src)
        return
    received = [torch.zeros_like(trainer.theta[i]) for i, _ in keys]
    comm.broadcast_tensors(received, src)
    trainer.load_outer_state(dict(zip(keys, received, strict=True)), scalars)


def maybe_merge(
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    merge: MergeConfig,
    round_index: int,
) -> MergeEvent | None:
    """Every ``merge.every`` rounds, merge the trainers with the smallest b_req into the first of them (removed
    from ``trainers``; their workers, hosted here or not, now belong to it)."""
    if merge.policy == "off" or len(trainers) < 2 or (round_index + 1) % merge.every != 0:
        return None
    b_req = {k: t.batch_size for k, t in trainers.items()}
    group = select_merge_group(b_req, min(merge.group_size, len(trainers)))
    members = [trainers[k] for k in group]
    weights = merge_weights(merge.policy, [t.batch_size for t in members], [len(t.worker_ids) for t in members])
    theta = weighted_average([t.theta for t in members], weights)
    survivor = members[0]
    with torch.no_grad():
        for target, value in zip(survivor.theta, theta, strict=True):
            target.copy_(value)
    _merge_outer_state(members, list(weights))
    survivor.batch_size = merged_batch_size([t.batch_size for t in members])
    for other in members[1:]:
        survivor.worker_ids = sorted(survivor.worker_ids + other.worker_ids)
        del trainers[other.trainer_id]
    survivor.broadcast(workers)
    comm.register_group(survivor.worker_ids)
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


def _merge_outer_state(members: list[Trainer], weights: list[float]) -> None:
    """The survivor's outer state: every per-element tensor (momentum, Adam's moments) averaged with the merge's
    weights, a member without one counting zeros; step counts the survivor's (the trainers step in lockstep)."""
    states = [member.outer_state() for member in members]
    keys = sorted(set().union(*(tensors for tensors, _ in states)))
    averaged = weighted_average([[tensors.get(k) for k in keys] for tensors, _ in states], weights)
    scalars: dict[int, dict] = {}
    for _, member_scalars in reversed(states):
        scalars.update(member_scalars)
    members[0].load_outer_state({k: t for k, t in zip(keys, averaged, strict=True) if t is not None}, scalars)
