"""What the parts of a run's round loop share: the run's state, a round's plan before it runs and its record
waiting for every rank's figures after."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adloco.algorithms.schedules import inner_lr
from adloco.cluster.cluster import Cluster, MergeEvent
from adloco.comm.base import Communicator
from adloco.config import InnerConfig, TrainConfig
from adloco.metrics.writer import MetricsWriter
from adloco.workers.tasks import Task


@dataclass
class PendingRound:
    """A round's record, waiting for every rank's traffic figures: gathered without blocking any rank, so a
    round costs its own exchanges and nothing more, and written at the next round's end (or before a
    checkpoint, whose byte count includes the round)."""

    traffic: torch.futures.Future
    step_records: list[dict]
    record: dict
    merge: MergeEvent | None


@dataclass
class RunState:
    """What the parts of the round loop share."""

    config: TrainConfig
    run_dir: Path
    task: Task
    comm: Communicator
    device: torch.device
    cluster: Cluster
    counters: dict
    metrics: MetricsWriter | None
    eval_model: torch.nn.Module | None
    started: float
    last_checkpoint: int | None = None  # the round of the newest checkpoint on disk
    checkpointed_at: float = field(default_factory=time.monotonic)
    last_val: dict[int, float] = field(default_factory=dict)
    last_accuracy: dict[int, float] = field(default_factory=dict)
    failed_streak: int = 0
    pending: PendingRound | None = None  # the last round's record, until every rank's figures are in
    flops_per_token: float = 0.0  # the model's training FLOPs per token (adloco.algorithms.flops)
    peak_flops: float | None = None  # the job's devices together, FLOP/s; None where unknown: no MFU
    last_mfu: float | None = None  # the last round's, for the progress line

    @property
    def is_root(self) -> bool:
        return self.comm.rank == 0


@dataclass
class RoundPlan:
    """A round before it runs: its length, its switch-mode plans and the inner lr of each step."""

    index: int
    steps: int
    first_step: int
    tokens_before: int
    per_step: int
    plans: dict
    started: float
    samples: dict[int, int] = field(default_factory=dict)  # each worker's samples per step in the round
    sync_every: int = 0  # the round's H (steps is less where the budget cuts the last round short)

    def lr_at(self, inner: InnerConfig, total_tokens: int, step: int) -> float:
        """The inner lr at ``step`` of this round: the schedule decays over the run's ``total_tokens``."""
        fraction = (self.tokens_before + step * self.per_step) / total_tokens
        return inner_lr(self.first_step + step, fraction, inner.lr, inner.min_lr, inner.warmup_steps)
