"""What the framework integrations share for fault-tolerant replicas: each replica is one process of the framework
(no torchrun), and a replica that heals from a peer takes the peers' inner step, which the framework counts itself:
its step counter and its learning-rate schedule are moved forward to it."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch


def check_replica_launch(settings: dict[str, Any], processes: int, resuming: bool, framework: str) -> None:
    """Refuse what a fault-tolerant replica cannot be in ``framework``: one of several processes the framework
    launched, or a run resumed from the framework's checkpoint (a replica heals from its peers instead)."""
    if settings.get("fault_tolerance") is None:
        return
    if processes > 1:
        raise ValueError(
            f"fault_tolerance: each replica is one process of its own, but the {framework} runs {processes}: start "
            "each replica as a plain process (not under torchrun), with its own fault_tolerance.replica"
        )
    if resuming:
        raise ValueError(
            f"fault_tolerance: a replica heals from its peers when it starts again; resuming it from the {framework}'s "
            "checkpoint is not supported (start it without resume_from_checkpoint / ckpt_path)"
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
