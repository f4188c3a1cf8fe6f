"""What the framework integrations share for fault-tolerant replicas: each replica is one process of the framework
(no torchrun), and a replica that heals from a peer takes the peers' inner step, which the framework counts itself:
its step counter and its learning-rate schedule are moved forward to it. A replica resumed from the framework's
checkpoint gives its DiLoCo state to ``DiLoCo(state=...)``, before its first quorum: peers further on heal it, and
replicas all resumed from checkpoints of one step go on from there.

Its data goes on from the job's step too: from the epoch and the batch of it where a replica that never stopped
reads at that step. The skipped batches' indices are drawn from the batch sampler, and none of their samples is
loaded, so a skip deep into a large epoch costs no data loading."""

from __future__ import annotations

import collections
import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset


def is_replica(settings: dict[str, Any]) -> bool:
    return settings.get("fault_tolerance") is not None


def check_replica_launch(settings: dict[str, Any], processes: int, framework: str) -> None:
    """Refuse what a fault-tolerant replica cannot be in ``framework``: one of several processes it launched."""
    if is_replica(settings) and processes > 1:
        raise ValueError(
            f"fault_tolerance: each replica is one process of its own, but the {framework} runs {processes}: start "
            "each replica as a plain process (not under torchrun), with its own fault_tolerance.replica"
        )


def steps_behind(diloco: Any, framework_step: int) -> int:
    """How many inner steps the framework's counter is behind DiLoCo's (a heal took the peers' step); 0 else."""
    if diloco is None or diloco.replica is None:
        return 0
    behind = diloco.inner_step - framework_step
    if behind < 0:
        raise RuntimeError(f"the framework counts {framework_step} optimizer steps, DiLoCo {diloco.inner_step}")
    return behind


def advance_schedules(schedulers: Iterable[Any], steps: int) -> None:
    """Step each learning-rate scheduler ``steps`` times, as if the steps a heal skipped had been taken here (one
    on a metric, ``ReduceLROnPlateau``, follows its metric instead)."""
    with warnings.catch_warnings():  # torch warns of a schedule stepped before the optimizer's first step
        warnings.simplefilter("ignore", UserWarning)
        for scheduler in schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                continue
            for _ in range(steps):
                scheduler.step()


def data_position(step: int, per_epoch: int, accumulation: int) -> tuple[int, int]:
    """Where a replica that never stopped reads after ``step`` optimizer steps, ``per_epoch`` to an epoch, of
    ``accumulation`` batches each: the epoch, and how many of its batches were read already."""
    return step // per_epoch, (step % per_epoch) * accumulation


def steps_per_epoch(batches: int, accumulation: int) -> int:
    """The optimizer steps of an epoch of ``batches`` batches: the last one may take fewer than ``accumulation``."""
    return max(-(-batches // accumulation), 1)


class SkippedBatches:
    """``batch_sampler`` whose passes leave out their first ``batches`` batches until ``batches`` is set to 0 (at
    the first batch trained: a framework may start a pass, and start it again, before it trains on one)."""

    def __init__(self, batch_sampler: Any, batches: int) -> None:
        self.batch_sampler, self.batches = batch_sampler, batches

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.batch_sampler)
        collections.deque(itertools.islice(batches, self.batches), maxlen=0)  # their indices only: nothing loaded
        yield from batches

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:  # the wrapped sampler's batch_size, drop_last, sampler
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def skip_batches(loader: Any, batches: int, framework: str) -> SkippedBatches | None:
    """Make ``loader``'s passes start ``batches`` batches in (see ``SkippedBatches``); None, with a warning, where
    its data cannot be skipped by index (an iterable dataset, no batch sampler), and the replica reads it from its
    start."""
    dataset, batch_sampler = getattr(loader, "dataset", None), getattr(loader, "batch_sampler", None)
    if isinstance(dataset, IterableDataset) or batch_sampler is None:
        why = "an iterable dataset" if isinstance(dataset, IterableDataset) else "no batch sampler"
        cannot_skip(framework, f"{type(loader).__name__} of {why}")
        return None
    skipped = SkippedBatches(batch_sampler, batches)
    object.__setattr__(loader, "batch_sampler", skipped)  # a DataLoader refuses a new batch sampler once built
    return skipped


def cannot_skip(framework: str, why: str, reads: str = "from the start of an epoch") -> None:
    """The one warning of a replica whose data cannot follow the job's step after a heal."""
    warnings.warn(
        f"this replica healed at a later step than its {framework}'s data is at, and its data cannot skip to it "
        f"({why}): it reads its data {reads}",
        stacklevel=3,
    )


def shift_sampler_epochs(sampler: Any, epochs: int) -> None:
    """Make ``sampler``'s epochs ``epochs`` later: a loop that counts its epochs from another start than the job
    then reads the order of the job's epoch (a sampler whose order does not follow its epoch is left alone)."""
    set_epoch = getattr(type(sampler), "set_epoch", None)
    if epochs and callable(set_epoch):
        # every pass's order is set from the loop's epoch before it starts (accelerate's loader does so each time),
        # so a sampler that moves its own epoch on after a pass is set again, not shifted twice
        sampler.set_epoch = lambda epoch: set_epoch(sampler, epoch + epochs)
