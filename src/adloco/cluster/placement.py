"""Which rank hosts which worker: contiguous blocks of worker slots per rank, a worker's shards on neighbouring
ranks; the check, before anything is built, that the world torchrun started can hold the job; an elastic job's
size; and each rank's device."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from adloco.config import WorldSpec
from adloco.errors import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch


def rank_placement(total_workers: int, world_size: int, slots_per_rank: int | None) -> dict[int, int]:
    """Which rank hosts each worker slot: contiguous blocks of ``slots_per_rank`` worker ids per rank."""
    slots = slots_per_rank or total_workers // world_size
    if slots == 0 or slots * world_size != total_workers:
        spread = f"{slots_per_rank} slots each" if slots_per_rank else "the same number each"
        raise ConfigError(
            f"slots_per_rank: {total_workers} worker(s) do not fill {world_size} rank(s) with {spread}; give workers "
            f"(× trainers) a multiple of {world_size}, or launch ranks × slots_per_rank = {total_workers}"
        )
    return {w: w // slots for w in range(total_workers)}


def placement(trainers: int, workers_per_trainer: int) -> dict[int, list[int]]:
    """Worker ids of each trainer at the start: trainer k owns workers k·M … k·M + M − 1."""
    return {k: list(range(k * workers_per_trainer, (k + 1) * workers_per_trainer)) for k in range(trainers)}


def hosted_workers(
    rank: int, world_size: int, *, total_workers: int, slots_per_rank: int | None, shards: int
) -> set[int]:
    """The workers that global ``rank`` of ``world_size`` hosts (a shard of each when workers are sharded): a
    worker's ``shards`` neighbouring ranks count as one rank of the placement."""
    placed = rank_placement(total_workers, world_size // shards, slots_per_rank)
    return {w for w, r in placed.items() if r == rank // shards}


def check_world(spec: WorldSpec, world_size: int, torchrun: bool) -> None:
    """ConfigError, before anything is built, when the ranks cannot host the job: sharded workers outside torchrun
    or on a world that is not a multiple of ``shards``, workers that do not fill the ranks, a backend this machine
    lacks."""
    shards = spec.shards
    if shards > 1 and not torchrun:
        raise ConfigError(
            f"shards={shards}: a worker sharded over {shards} ranks needs torchrun, one process per rank, with a "
            f"world size that is a multiple of {shards}"
        )
    if world_size < shards or world_size % shards:
        raise ConfigError(
            f"shards={shards}: torchrun started {world_size} rank(s); sharded workers need a world size that is a "
            f"multiple of {shards} (ranks = workers ÷ slots_per_rank × shards)"
        )
    if torchrun:
        _check_backend(spec.backend, spec.device)
    if not (spec.elastic and torchrun):  # an elastic job takes its worker count from the ranks
        rank_placement(spec.total_workers, world_size // shards, spec.slots_per_rank)


def _check_backend(backend: str, device: str) -> None:
    if backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    if device == "cpu":
        raise ConfigError("comm.backend: nccl exchanges CUDA tensors; with device=cpu use comm.backend=gloo")
    if not torch.cuda.is_available():
        raise ConfigError("comm.backend: nccl needs CUDA GPUs and this machine has none; use comm.backend=gloo")
    if not dist.is_nccl_available():
        raise ConfigError("comm.backend: nccl is not built into this torch; use comm.backend=gloo")


def elastic_size(
    workers: int, world_size: int, fresh: bool, *, elastic: bool, slots_per_rank: int | None, given: bool
) -> tuple[int, str | None]:
    """The worker count of this start, of a config that names ``workers``: under torchrun an ``elastic`` job has as
    many workers as its ranks hold slots; and a line for the user when that is not ``workers``. A fresh start
    refuses a ``workers`` the user gave (``given``) that the ranks contradict."""
    from adloco.comm.distributed import launched_by_torchrun  # torch loads only when a job starts

    if not elastic or not launched_by_torchrun():
        return workers, None
    slots = slots_per_rank or 1
    sized = world_size * slots
    if sized == workers:
        return workers, None
    why = f"{world_size} ranks × {slots} worker slot(s) = {sized} workers"
    if fresh and given:
        raise ConfigError(
            f"workers={workers}: an elastic job has one worker per rank slot, here {why}; leave workers out, "
            f"or launch ranks × slots_per_rank = {workers}"
        )
    # A resumed or restarted job says the change with the other resume-time changes ("workers: 4 -> 3").
    note = f"elastic: this job has {why}, not workers={workers}" if fresh else None
    return sized, note


def resolve_device(device: str, precision: str, tf32: bool) -> tuple[torch.device, str]:
    """This rank's device (the CPU, or the CUDA device of its local rank, with the ``tf32`` matmul setting) and the
    precision it trains in, ``precision=auto`` decided for it (bf16 on a CUDA GPU that has it, else fp32). The
    caller records that precision in its config, as config.yaml does: an auto run resumes in what it trained."""
    import os

    import torch

    from adloco.models.precision import configure_matmuls, resolved_precision

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        if precision == "fp16":
            log.warning("precision fp16 on a CPU: float16 matmuls have no fast kernels there; bf16 or fp32 is faster")
        cpu = torch.device("cpu")
        return cpu, resolved_precision(precision, cpu)
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    cuda = torch.device("cuda", local_rank)
    configure_matmuls(cuda, tf32)
    return cuda, resolved_precision(precision, cuda)
