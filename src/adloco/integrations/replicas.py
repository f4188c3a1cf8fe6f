"""What the framework integrations share for fault-tolerant replicas: each replica is one process of the framework
(no torchrun), and a replica that heals from a peer takes the peers' inner step, which the framework counts itself:
its step counter and its learning-rate schedule are moved forward to it. A replica resumed from the framework's
checkpoint gives its DiLoCo state to ``DiLoCo(state=...)``, before its first quorum: peers further on heal it, and
replicas all resumed from checkpoints of one step go on from there."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch


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
