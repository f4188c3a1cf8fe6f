"""Sync strategies: one per method family, chosen once from the config. Each owns its exchanges and its
per-worker outer state; the cluster and the round loop hold no method branches."""

from __future__ import annotations

from collections.abc import Mapping

from adloco.algorithms.codecs import get_codec
from adloco.algorithms.outer import OuterFactory
from adloco.comm.base import Communicator
from adloco.config import TrainConfig
from adloco.sync.base import SyncStrategy
from adloco.sync.ddp import DDPSync
from adloco.sync.diloco import DiLoCoSync
from adloco.sync.exchange import DeltaExchange
from adloco.sync.overlapped import EagerCopy, OverlappedSync
from adloco.sync.rounds import RoundState, StepRecord, WorkerRound
from adloco.sync.streaming import StreamingSync
from adloco.trainer import Trainer
from adloco.worker import Worker

__all__ = [
    "DDPSync",
    "DeltaExchange",
    "DiLoCoSync",
    "EagerCopy",
    "OverlappedSync",
    "RoundState",
    "StepRecord",
    "StreamingSync",
    "SyncStrategy",
    "WorkerRound",
    "build_strategy",
]


def build_strategy(
    config: TrainConfig,
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    outer_factory: OuterFactory | None = None,
) -> SyncStrategy:
    """The strategy of ``config.method`` (LocalSGD and AdLoCo are DiLoCo with other outer/batch settings);
    ``outer_factory``: the outer optimizer of each worker's own copy under eager overlap (default: outer SGD)."""
    if config.method == "ddp":
        return DDPSync(config, comm, trainers, workers)
    codec = None if config.codec.name == "none" else get_codec(config.codec.name, config.codec.block_size)
    exchange = DeltaExchange(comm, codec, config.codec.error_feedback, sorted(workers))
    if config.method == "streaming":
        return StreamingSync(config, comm, trainers, workers, exchange)
    if config.outer.overlap != "none":
        eager = config.outer.overlap == "eager"
        return OverlappedSync(config, comm, trainers, workers, exchange, eager=eager, outer_factory=outer_factory)
    return DiLoCoSync(config, comm, trainers, workers, exchange)
