"""``adloco train``'s own parts for a loop of one's own: the model, the inner optimizer, worker w's sample stream, the
inner learning rate and DiLoCo's settings of a run's config, built by the functions ``adloco train`` builds them
with. A loop made of them with ``adloco.DiLoCo`` ends on the bits of ``adloco train``'s run of the same config
(``batched_workers=false``, one worker per rank)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from adloco.algorithms.schedules import inner_lr
from adloco.config import TrainConfig, build_config
from adloco.config.methods import METHODS

if TYPE_CHECKING:  # the tasks load the model library: a plain loop never imports them
    from adloco.workers.tasks import Task


@dataclass
class TrainParts:
    """One worker's parts of a run: ``config``, ``task`` (its loss: ``task.loss(model, inputs, targets)``),
    ``model``, ``optimizer`` (the config's inner optimizer over it) and ``stream`` (``stream.next_batch(b)`` gives
    the inputs and targets of b samples, as the worker of ``adloco train`` reads them)."""

    config: TrainConfig
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    stream: Any

    def diloco_settings(self) -> dict[str, Any]:
        """``DiLoCo``'s arguments from the config: ``DiLoCo(parts.model, parts.optimizer, **parts.diloco_settings())``
        (AdLoCo: its batch section and the budget in samples)."""
        return diloco_arguments(self.config, self.task.context)

    def lr(self, step: int, tokens: int) -> float:
        """The inner lr of inner step ``step`` (0-based) when the job has read ``tokens`` of its ``total_tokens``
        (over every worker): linear warm-up over ``inner.warmup_steps`` steps, then the cosine over the budget
        counted from token 0."""
        inner = self.config.inner
        return inner_lr(step, tokens / self.config.total_tokens, inner.lr, inner.min_lr, inner.warmup_steps)

    def set_lr(self, step: int, tokens: int) -> None:
        """Set ``lr(step, tokens)`` on every parameter group of the optimizer (before its step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(step, tokens)


def diloco_arguments(config: TrainConfig, context: int, replica: bool = False) -> dict[str, Any]:
    """``DiLoCo``'s keyword arguments from a run's config: the method, H and trainers, the sections every method
    reads, the method's own (streaming's fragments, AdLoCo's batch and its budget in samples of ``context`` tokens)
    and, for a fault-tolerant replica, its ``fault_tolerance`` section."""
    method = METHODS[config.method]
    names = ("outer", "codec", "sync_auto", "merge", *(("fault_tolerance",) if replica else ()), *method.sections)
    arguments: dict[str, Any] = {"sync_every": config.sync_every, "method": config.method, "trainers": config.trainers}
    arguments |= {name: getattr(config, name).model_dump() for name in names}
    if method.adaptive_batch:
        arguments["total_samples"] = config.total_tokens // context
    return arguments


def train_parts(overrides: Sequence[str] = (), worker: int = 0, workers: int = 1) -> TrainParts:
    """Worker ``worker`` of ``workers``'s parts of the run ``adloco train`` would start with these ``key=value``
    overrides (its tokenizer, data, model and optimizer; imported here, so that a plain loop does not load them)."""
    from adloco.cluster.placement import resolve_device
    from adloco.models.precision import adamw_kernel
    from adloco.run.training import tokenizer_and_task
    from adloco.workers.inner_optimizer import inner_optimizer

    config = build_config(overrides=list(overrides))
    _, task = tokenizer_and_task(config, None)
    device, config.precision = resolve_device(config.device, config.precision, config.tf32)
    model = task.build_model(config.seed).to(device)
    optimizer = inner_optimizer(model, config.inner, adamw_kernel(device))
    return TrainParts(config, task, model, optimizer, task.worker_stream(config.seed, worker, workers))
