"""A user's loop's settings: the method, H, the job's trainers and workers and the config sections ``DiLoCo``'s parts
are built from, validated by the rules ``adloco train`` validates its config with (the same keys, per-method
defaults and one-line errors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from adloco.config import (
    BatchConfig,
    CodecConfig,
    ConfigError,
    FaultToleranceConfig,
    MergeConfig,
    OuterConfig,
    StreamingConfig,
    SyncAutoConfig,
    build_config,
)
from adloco.config.methods import method_named


@dataclass(frozen=True)
class LoopSettings:
    """What ``DiLoCo`` is built from; each part takes its own sections."""

    method: str
    sync_every: int | Literal["auto"]
    first_sync_every: int  # H of the first round (sync_every, or auto's start within its bounds)
    trainers: int
    workers: int  # per trainer
    outer: OuterConfig
    streaming: StreamingConfig
    codec: CodecConfig
    batch: BatchConfig
    merge: MergeConfig
    sync_auto: SyncAutoConfig
    fault_tolerance: FaultToleranceConfig


def loop_settings(
    method: str, sync_every: int | str, world_size: int, sections: dict[str, Any], trainers: int = 1
) -> LoopSettings:
    """The settings of a loop of ``world_size`` workers split into ``trainers``; ``sections`` maps a section's
    name to its keys (None: its defaults for the method)."""
    method_named(method)  # an unknown one named first, with the choices
    if trainers < 1 or world_size % trainers:
        raise ConfigError(f"trainers: {world_size} rank(s) do not split into {trainers} trainers of as many workers")
    given = {name: dict(value) for name, value in sections.items() if value is not None}
    top = {"method": method, "sync_every": sync_every, "trainers": trainers, "workers": world_size // trainers}
    # the root config validates the whole (its rules span sections); the loop keeps the sections it reads
    config = build_config({**top, **given})
    assert config.sync_every is not None and config.trainers and config.workers  # the validators set them
    return LoopSettings(
        config.method,
        config.sync_every,
        config.first_sync_every,
        config.trainers,
        config.workers,
        config.outer,
        config.streaming,
        config.codec,
        config.batch,
        config.merge,
        config.sync_auto,
        config.fault_tolerance,
    )
