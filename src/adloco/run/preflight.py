"""Checks before a run allocates its workers: does what this rank is asked to hold fit in its memory?"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from adloco.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from adloco.config import DataConfig, ModelConfig, WorldSpec

_FLOAT = 4  # bytes: parameters, gradients and optimizer state are float32
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """A lower-bound estimate of one rank's training memory, in bytes, and what it is made of."""

    per_worker: int
    per_trainer: int
    workers: int
    trainers: int

    @property
    def total(self) -> int:
        return self.per_worker * self.workers + self.per_trainer * self.trainers


def estimate_memory(
    parameters: int,
    workers: int,
    trainers: int,
    batch: int,
    context: int,
    hidden: int,
    layers: int,
    shards: int = 1,
) -> MemoryEstimate:
    """Each hosted worker: weights, gradients and AdamW's two moments (4 copies) plus the activations of one
    micro-batch (about 8 floats per token, layer and hidden unit); each trainer: θ and the outer momentum. A rank
    holding one of ``shards`` shards of its workers holds that share of all of it (and of every step's samples).

    Deliberately low (no allocator slack, no buffers of the exchange): a run refused by it could not fit.
    """
    activations = 8 * -(-batch // shards) * context * hidden * layers * _FLOAT
    return MemoryEstimate(
        per_worker=4 * -(-parameters // shards) * _FLOAT + activations,
        per_trainer=2 * -(-parameters // shards) * _FLOAT,
        workers=workers,
        trainers=trainers,
    )


def available_memory() -> int | None:
    """Bytes this process may still use: the smaller of MemAvailable and the cgroup's limit; None if unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            found.append(int(text))
    return min(found) if found else None


def check_memory(estimate: MemoryEstimate, available: int | None) -> None:
    """ConfigError naming the numbers when the estimate does not fit in ``available``."""
    if available is None or estimate.total <= available:
        return
    raise ConfigError(
        f"this rank would need at least {estimate.total / _GIB:,.1f} GiB ({estimate.workers:,} worker(s) × "
        f"{estimate.per_worker / 2**20:,.0f} MiB + {estimate.trainers:,} trainer(s) × "
        f"{estimate.per_trainer / 2**20:,.0f} MiB) but {available / _GIB:,.1f} GiB is available; use fewer "
        "workers or trainers, a smaller batch.size or model, or more ranks"
    )


def check_rank_memory(
    model: torch.nn.Module, context: int, hosted_workers: int, *, trainers: int | None, batch_size: int, shards: int
) -> None:
    """Refuse, naming the numbers, a rank whose workers cannot fit in host memory (before anything is made): its
    ``hosted_workers`` at ``batch_size`` samples of ``context`` tokens, the ``trainers``' states, a worker's part
    of ``shards``."""
    settings = getattr(model, "config", None)
    estimate = estimate_memory(
        parameters=sum(p.numel() for p in model.parameters()),
        workers=hosted_workers,
        trainers=trainers or 1,
        batch=batch_size,
        context=context,
        hidden=int(getattr(settings, "hidden_size", 0) or 0),
        layers=int(getattr(settings, "num_hidden_layers", 0) or 0),
        shards=shards,
    )
    check_memory(estimate, available_memory())


def check_inputs(
    task: Literal["lm", "classification"],
    model: ModelConfig,
    data: DataConfig,
    resume: Path | None = None,
    *,
    world: WorldSpec | None = None,
    run_root: str | None = None,
) -> None:
    """What a run's settings name, checked before torch is imported: the ranks the launcher started against what
    they must hold (``world``), the run directory under ``run_root`` (or ``resume``'s checkpoint), and a language
    model's data source (``adloco.data.preflight``). A fault-tolerant replica's world and run directory are its
    own: it gives neither ``world`` nor ``run_root``."""
    from adloco.cluster.placement import check_world
    from adloco.comm.launcher import launched_by_torchrun, world_size_from_env
    from adloco.config.sections import PRESETS
    from adloco.data.preflight import check_data

    if world is not None:
        check_world(world, world_size_from_env(), launched_by_torchrun())
    if run_root is not None:
        check_run_root(run_root, resume)
    if task == "lm":
        preset = PRESETS.get(model.preset or "")
        check_data(data, model.context or (preset[5] if preset else None))


def check_run_root(run_root: str | Path, resume: Path | None) -> None:
    """A run to resume holds a checkpoint; a new one can be made under ``run_root`` (its nearest existing folder
    is a folder this process may write in)."""
    from adloco.checkpoint.names import check_resumable

    if resume is not None:
        check_resumable(resume)
        return
    root = Path(run_root)
    existing = next((p for p in (root, *root.parents) if p.exists()), Path("."))
    problem = "a file" if not existing.is_dir() else "" if os.access(existing, os.W_OK | os.X_OK) else "not writable"
    if problem:
        raise ConfigError(f"run directories cannot be created under run.root '{root}': '{existing}' is {problem}")
