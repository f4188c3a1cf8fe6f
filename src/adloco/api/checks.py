"""What a user's loop is checked for before and while DiLoCo trains it: the optimizer and the job's layout, that
every rank built the same model and DiLoCo (naming what differs), optimizer steps DiLoCo did not see, and a finish()
never called (that the ranks ended with as many steps: finish_line.py). Each refusal is one line on every rank."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from adloco.api.finish_line import FinishLine
from adloco.api.rounds import LoopRounds
from adloco.api.settings import LoopSettings
from adloco.api.worker import WorkerShards
from adloco.comm.base import Communicator


def job_fingerprint(
    settings: LoopSettings, rows: Sequence[torch.Tensor], shards: WorkerShards | None, check_finite: bool
) -> dict[str, float]:
    """What every rank must agree on, as it decides which collectives run, each under its name: the method, H,
    fragments, codec, batch, trainers and merges, the health checks, each rank's model shapes and dtypes and which
    shard of its worker it holds (the ranks that exchange hold the same rows of different workers)."""
    batch = (settings.batch.size, settings.batch.test, settings.batch.controller, settings.batch.memory.b_max)
    merge = (settings.trainers, settings.merge.policy, settings.merge.every, settings.merge.group_size)
    codec = (settings.codec.name, settings.codec.density, settings.codec.value_bits, settings.codec.chunk_size)
    agreed = {"method": settings.method, "sync_every": settings.sync_every, "streaming.fragments":
              settings.streaming.fragments, "codec": codec, "batch": batch, "trainers and merge": merge,
              "check_finite": check_finite}  # fmt: skip
    model = tuple((tuple(p.shape), str(p.dtype)) for p in rows)
    shard = (1, 0) if shards is None else (shards.count, shards.index)
    return {"shard": digest(shard), "model": digest((len(rows), sum(p.numel() for p in rows), model)),
            **{name: digest(value) for name, value in agreed.items()}}  # fmt: skip


def digest(value: Any) -> float:
    """A number that tells values apart alike in every process (unlike ``hash`` of text)."""
    return float(int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "big"))


def check_optimizer(optimizer: Any, params: list[torch.Tensor]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DiLoCo needs a torch.optim.Optimizer (the inner optimizer), got {type(optimizer).__name__}")
    if not params:
        raise ValueError("the model has no trainable parameters")
    mine = {id(p) for p in params}
    foreign = sum(id(p) not in mine for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ValueError(f"the optimizer updates {foreign} tensor(s) that are not the model's trainable parameters")


def check_layout(trainers: int, shards: WorkerShards | None, process_group: Any) -> None:
    """What DiLoCo cannot take on with this job's layout, refused before it connects to anything."""
    if trainers > 1 and (shards is not None or process_group is not None):
        raise ValueError("several trainers take a job of one rank per worker over the default process group")


def distributed_world_size(fault_tolerance: dict[str, Any] | None) -> int:
    """The ranks of the job under torch.distributed (1 without it; a fault-tolerant replica's peers are no ranks)."""
    import torch.distributed as dist

    if fault_tolerance is not None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def check_same_job(comm: Communicator, rank: int, fingerprint: dict[str, float]) -> None:
    """Every rank must hold a model of the same shapes and the same settings: refuse on every rank, naming what
    differs (rather than hang in a collective only some reach, or average unlike tensors)."""
    names = list(fingerprint)
    seen = comm.gather_worker_scalars({rank: [fingerprint[n] for n in names]})
    differ = [n for i, n in enumerate(names) if len({v[i] for v in seen.values()}) > 1]
    if not differ:
        return
    if "shard" in differ:
        raise ValueError(
            "the ranks exchange shards of different rows of a sharded model: a sharded model's workers exchange over "
            "the ranks holding the same shard (process_group=mesh['replicate'])"
        )
    if differ[0] == "model":
        raise ValueError(
            "the ranks hold different models (the shapes or dtypes of their trainable parameters): every rank must "
            "build the same model"
        )
    raise ValueError(f"the ranks' DiLoCo settings differ in {', '.join(differ)}: every rank must build the same "
                     "DiLoCo")  # fmt: skip


class StepCount:
    """A count of an optimizer's steps, bumped by its post-step hook."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, *_: object) -> None:
        self.count += 1


def warn_unfinished(rounds: LoopRounds, line: FinishLine | None = None) -> None:
    """Say that finish() never ran after rounds that trained; not after a refusal of unlike step counts, which said
    what was wrong (and may have come from inside an exchange, where finish() never could run)."""
    if rounds.count and (line is None or line.refusal is None):
        warnings.warn(
            f"adloco.DiLoCo: finish() was never called after {rounds.count} round(s): each rank's model is its own "
            "worker's, not θ, and the ranks may end different; call diloco.finish() after the loop",
            stacklevel=1,
        )
