"""Sync strategies: one per method family, chosen once from their own settings (the method, H and the config's
``outer``, ``streaming`` and ``codec`` sections). Each owns its exchanges and its per-worker outer state; the
cluster, the round loop and a user's loop hold no method branches. Which family runs a method is the method's
registration (``adloco.config.methods``); ``STRATEGIES`` builds each family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from adloco.algorithms.codecs import Codec, get_codec
from adloco.algorithms.outer import OuterFactory, adam_factory
from adloco.algorithms.sparse import TopKCodec
from adloco.comm.base import Communicator
from adloco.config import CodecConfig, OuterConfig, StreamingConfig
from adloco.config.methods import METHODS
from adloco.sync.base import SyncStrategy
from adloco.sync.ddp import DDPSync
from adloco.sync.diloco import DiLoCoSync
from adloco.sync.exchange import DeltaExchange
from adloco.sync.overlapped import EagerCopy, OverlappedSync
from adloco.sync.streaming import StreamingSync
from adloco.sync.trainer import Trainer
from adloco.workers.reports import RoundState, StepRecord, WorkerRound
from adloco.workers.worker import Worker

__all__ = [
    "DDPSync",
    "DeltaExchange",
    "DiLoCoSync",
    "EagerCopy",
    "OverlappedSync",
    "RoundState",
    "STRATEGIES",
    "StepRecord",
    "StreamingSync",
    "SyncSettings",
    "SyncStrategy",
    "WorkerRound",
    "build_codec",
    "build_strategy",
    "outer_factory",
]


@dataclass(frozen=True)
class SyncSettings:
    """What a sync strategy is built from: the method, H (inner steps per round) and the config's sections for
    the outer step, streaming fragments and the exchange's codec, validated as ``adloco train`` validates them."""

    method: str
    sync_every: int
    outer: OuterConfig
    streaming: StreamingConfig
    codec: CodecConfig

    @classmethod
    def of(cls, config: SyncSections) -> SyncSettings:
        return cls(config.method, config.first_sync_every, config.outer, config.streaming, config.codec)


class SyncSections(Protocol):
    """Where sync settings are read from: ``adloco train``'s config or a user's loop's settings."""

    @property
    def method(self) -> str: ...
    @property
    def first_sync_every(self) -> int: ...
    @property
    def outer(self) -> OuterConfig: ...
    @property
    def streaming(self) -> StreamingConfig: ...
    @property
    def codec(self) -> CodecConfig: ...


def build_codec(codec: CodecConfig) -> Codec | None:
    """The codec of the config's ``codec`` section (None: float32 through the summing path)."""
    if codec.name == "none":
        return None
    if codec.name == "topk":
        return TopKCodec(codec.density, codec.value_bits, codec.chunk_size)
    return get_codec(codec.name, codec.block_size)


def outer_factory(outer: OuterConfig) -> OuterFactory | None:
    """The outer optimizer ``outer.optimizer`` names, as a factory; None for outer SGD (the built-in default)."""
    if outer.optimizer == "adam":
        assert outer.lr is not None
        return adam_factory(outer.lr, outer.betas, outer.eps)
    return None


StrategyBuilder = Callable[
    [SyncSettings, Communicator, dict[int, Trainer], Mapping[int, Worker], OuterFactory | None], SyncStrategy
]


def _exchange(settings: SyncSettings, comm: Communicator, workers: Mapping[int, Worker]) -> DeltaExchange:
    codec = settings.codec
    return DeltaExchange(comm, build_codec(codec), bool(codec.error_feedback), sorted(workers), codec.feedback_decay)


def _ddp(
    settings: SyncSettings,
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    factory: OuterFactory | None,
) -> SyncStrategy:
    return DDPSync(comm, trainers, workers)


def _diloco(
    settings: SyncSettings,
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    factory: OuterFactory | None,
) -> SyncStrategy:
    """DiLoCo's whole-model rounds (LocalSGD and AdLoCo are DiLoCo with other outer and batch settings), overlapped
    with the next round under ``outer.overlap``."""
    exchange = _exchange(settings, comm, workers)
    if settings.outer.overlap == "none":
        return DiLoCoSync(comm, trainers, workers, exchange)
    return OverlappedSync(
        comm,
        trainers,
        workers,
        exchange,
        outer=settings.outer,
        eager=settings.outer.overlap == "eager",
        outer_factory=factory or outer_factory(settings.outer),
    )


def _streaming(
    settings: SyncSettings,
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    factory: OuterFactory | None,
) -> SyncStrategy:
    exchange = _exchange(settings, comm, workers)
    return StreamingSync(comm, trainers, workers, exchange, stream=settings.streaming, sync_every=settings.sync_every)


# Each strategy family a registered method names (its ``strategy``), built.
STRATEGIES: dict[str, StrategyBuilder] = {"ddp": _ddp, "diloco": _diloco, "streaming": _streaming}


def build_strategy(
    settings: SyncSettings,
    comm: Communicator,
    trainers: dict[int, Trainer],
    workers: Mapping[int, Worker],
    factory: OuterFactory | None = None,
) -> SyncStrategy:
    """The strategy of ``settings.method``'s family; ``factory``: the outer optimizer of each worker's own copy under
    eager overlap (default: ``settings.outer``'s)."""
    return STRATEGIES[METHODS[settings.method].strategy](settings, comm, trainers, workers, factory)
