"""All trainers and their workers: placement of worker slots, the round loop of inner steps, merges."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from adloco.algorithms.batch_tests import GradientStatistics
from adloco.algorithms.controller import StepCost
from adloco.algorithms.schedules import inner_lr
from adloco.algorithms.sharding import local_shard
from adloco.algorithms.switch import MicroBatchPlan
from adloco.algorithms.sync_every import SyncDecision
from adloco.batch.pace import CostModel, pinned_costs, time_steps, timed_batches
from adloco.batch.policy import TrainerBatch
from adloco.cluster import state as cluster_state
from adloco.cluster import trainers as trainer_sync
from adloco.cluster.batches import RoundBatches, auto_sync_every
from adloco.cluster.placement import placement, rank_placement
from adloco.cluster.round_end import RoundEnd, ShardSum
from adloco.cluster.trainers import MergeEvent
from adloco.comm.base import Communicator
from adloco.config import BatchConfig, ConfigError, InnerConfig, TrainConfig
from adloco.config.methods import METHODS
from adloco.sync import RoundState, SyncSettings, SyncStrategy, WorkerRound, build_strategy, outer_factory
from adloco.sync.streaming import parameter_fragments
from adloco.sync.trainer import Trainer, theta_device
from adloco.workers.engine import RankEngine, worker_groups
from adloco.workers.probe import CudaMemoryMeter, MemoryMeter, ProcessMemoryMeter, probe_b_max, training_step_at
from adloco.workers.reports import BoundaryRequest
from adloco.workers.tasks import Task
from adloco.workers.worker import Worker

log = logging.getLogger(__name__)

# Worker seeds are spread far apart so streams of different workers never share a generator state.


@dataclass
class StepProgress:
    """What this rank knows right after an inner step, before the round's exchange: its own workers' mean
    loss and the tokens the plans say the step reads (for progress display only)."""

    step: int
    lr: float
    loss: float
    tokens: int


@dataclass
class RoundReport:
    """A finished round, the same on every rank: per-step losses and tokens of every trainer, failures."""

    steps: int
    tokens: int
    loss: dict[int, float] = field(default_factory=dict)
    step_loss: list[dict[int, float]] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    batch: dict[int, dict] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    request: BoundaryRequest = BoundaryRequest()
    sync: dict = field(default_factory=dict)  # H of the next round and why (``SyncDecision.to_dict``)


def cuda_budget(memory_fraction: float, capacity_bytes: int, workers_on_device: int) -> int:
    """One worker's share of a GPU: ``memory_fraction`` of it split evenly among the workers that train on it
    (a rank's slots share its GPU, and the probe's step is one worker's)."""
    return int(memory_fraction * capacity_bytes / max(1, workers_on_device))


def resolve_b_max(
    batch: BatchConfig,
    model: torch.nn.Module,
    context: int,
    vocab_size: int,
    task: Task | None = None,
    workers_on_device: int = 1,
    *,
    shards: int = 1,
    precision: str = "auto",
) -> int:
    """b_max from the batch section, or probed with real steps (of ``task``'s batches and loss, in ``precision``): on
    CUDA under each worker's share of ``batch.memory.fraction`` of the device, on CPU under ``batch.memory.budget_mb``
    of process memory (without a budget a CPU worker is limited by b_cap). Workers sharded over ``shards`` ranks are
    not probed."""
    memory = batch.memory
    if memory.b_max is not None:
        return memory.b_max
    if shards > 1:  # a probe would hold the whole model on one device, and its shards would have to agree
        log.info(
            "sharded workers: no b_max probe; micro-batches of up to batch.b_cap=%d (set batch.memory.b_max)",
            batch.b_cap,
        )
        return batch.b_cap
    device = next(model.parameters()).device
    meter: MemoryMeter
    if device.type == "cuda":
        cuda = CudaMemoryMeter(device)
        meter, budget = cuda, cuda_budget(memory.fraction, cuda.capacity_bytes(), workers_on_device)
    elif memory.budget_mb is not None:
        meter, budget = ProcessMemoryMeter(), int(memory.budget_mb * 2**20)
    else:
        return batch.b_cap
    step = training_step_at(model, context, vocab_size, task, precision)
    found = probe_b_max(step, meter, budget, upper=batch.b_cap)
    if found == 0:
        raise ConfigError(f"batch: not even one sample fits in {budget / 2**20:.0f} MiB at context {context}")
    log.info("b_max probe on %s: %d samples per micro-batch fit in %.0f MiB (a worker's share; %d on the device)",
             device, found, budget / 2**20, workers_on_device)  # fmt: skip
    return found


class Cluster:
    """The trainers and the worker slots this rank hosts. Every rank runs the same rounds; when ranks meet
    is the sync strategy's business (``adloco.sync``), chosen once from the config."""

    def __init__(
        self,
        config: TrainConfig,
        task: Task,
        comm: Communicator,
        device: torch.device | None = None,
    ) -> None:
        assert config.trainers is not None and config.sync_every is not None
        self.config = config
        self.comm = shard_view(comm, config.shards)  # sharded workers: the ranks that hold the same shard
        self.task = task
        self.context = task.context
        self.device = device or torch.device("cpu")
        self.collect_statistics = METHODS[config.method].adaptive_batch or config.batch.test != "constant"
        self.trainers: dict[int, Trainer] = {}
        self.workers: dict[int, Worker] = {}
        comm = self.comm
        self.worker_rank = rank_placement(config.total_workers, comm.world_size, config.slots_per_rank)
        comm.set_placement(self.worker_rank)
        template, b_max = self._build(placement(config.trainers, config.workers))
        self.param_names = [name for name, _ in template.named_parameters()]
        self.param_shapes = [tuple(p.shape) for p in template.parameters()]
        self.groups = worker_groups(self.workers, config.batched_workers)
        self.sync: SyncStrategy = build_strategy(SyncSettings.of(config), comm, self.trainers, self.workers)
        # b_max is per worker device, and this table is its one owner: every rank learns every worker's, so all
        # plan the same token budget; an out-of-memory retry lowers it and the round's reports spread the news.
        shared = comm.gather_worker_scalars({w: [float(b_max)] for w in self.workers})
        self.b_max = {w: int(v[0]) for w, v in shared.items()}
        self.engine = RankEngine(self.workers, self.groups, self.b_max, config.batch)
        timed = config.batch.controller == "time" or config.batch.shares == "speed"
        self.costs = self._cost_model(template) if timed else pinned_costs(config.batch.time, self.worker_rank)
        shape = (config.total_workers, config.first_sync_every, self.context)
        cross_worker = partial(_cross_worker, comm, self.workers)
        auto = auto_sync_every(config.sync_every, config.sync_auto, config.streaming, config.workers)
        self.batches = RoundBatches(config.batch, self.trainers, self.b_max, self.costs, shape, self.collect_statistics,
                                    self.worker_rank, cross_worker, auto)  # fmt: skip
        self.round_end = RoundEnd(self.sync, comm, self.trainers, partial(_restart, self.workers), _shard_sum(comm))
        self.overhead_seconds = math.nan  # this rank's last round: wall time not spent computing steps
        # and its time between rounds before that one (evaluation, records: a peer waits for it at the exchange)
        self.between_seconds, self.ended = math.nan, math.nan
        self.retired_streams: dict[int, dict] = {}  # elastic: streams of workers a resize retired, by worker id
        self.resized: tuple[int, int] | None = None  # elastic: (workers in the checkpoint, workers now)

    def _cost_model(self, template: torch.nn.Module) -> CostModel:
        """Step costs timed on this rank's device (or pinned in the config), shared so every rank has all."""
        batch = self.config.batch
        pinned = pinned_costs(batch.time, self.worker_rank)
        if pinned is not None:
            return pinned
        worker_id = min(self.workers)
        worker = self.workers[worker_id]
        if self.comm.shards > 1:  # a sharded worker cannot be copied: time its own forward and backward
            step_at = worker.scratch_step(self.task)
        else:
            step_at = training_step_at(worker.model, self.context, self.task.vocab_size, self.task, worker.precision)
        top = min(batch.b_cap, self.b_max[worker_id])
        cost = time_steps(step_at, timed_batches(min(batch.size, top), top))
        timed = self.comm.sum_over_shards(torch.tensor([cost.overhead, cost.per_sample], dtype=torch.float64))
        timed = timed / self.comm.shards
        shared = self.comm.gather_worker_scalars({w: timed.tolist() for w in self.workers})
        return CostModel({w: StepCost(*v) for w, v in shared.items()}, True, batch.time.round_seconds)

    def _build(self, layout: dict[int, list[int]]) -> tuple[torch.nn.Module, int]:
        """Trainers from their initial models, and the worker slots this rank hosts."""
        config, task = self.config, self.task
        b_max, fragments = None, None
        for trainer_id, worker_ids in layout.items():
            template = task.build_model(config.seed if config.merge.shared_init else config.seed + trainer_id)
            if b_max is None:
                on_device = template.to(self.device) if config.shards == 1 else template  # never whole on a device
                here = sum(rank == self.comm.rank for rank in self.worker_rank.values())  # all on this device
                b_max = resolve_b_max(config.batch, on_device, self.context, task.vocab_size, task, here,
                                      shards=config.shards, precision=config.precision)  # fmt: skip
                template = template.cpu()
                fragments = parameter_fragments(config.streaming, [name for name, _ in template.named_parameters()])
            self.trainers[trainer_id] = self._trainer(trainer_id, template, worker_ids, fragments)
            self.comm.register_group(worker_ids)
            for worker_id in worker_ids:
                if self.worker_rank[worker_id] == self.comm.rank:
                    self.workers[worker_id] = self._worker(worker_id, template)
            self.trainers[trainer_id].broadcast(self.workers)
        assert b_max is not None
        return template, b_max

    def _trainer(
        self, trainer_id: int, template: torch.nn.Module, worker_ids: list[int], fragments: list[list[int]] | None
    ) -> Trainer:
        config = self.config
        home = theta_device(config.outer.device, self.device, 0, user_loop=False)
        return Trainer(
            trainer_id,
            [local_shard(p.detach(), self.comm.shard, self.comm.shards).to(home) for p in template.parameters()],
            worker_ids,
            TrainerBatch.from_config(config.batch),
            outer_lr=config.outer.lr,
            outer_momentum=config.outer.momentum,
            nesterov=bool(config.outer.nesterov),
            fragments=fragments,
            outer_factory=outer_factory(config.outer),
        )

    def _worker(self, worker_id: int, template: torch.nn.Module) -> Worker:
        config = self.config
        stream = self.task.worker_stream(config.seed, worker_id, config.total_workers)
        options = dict(loss_fn=self.task.loss, precision=config.precision, compile_step=config.compile)
        if self.comm.shards == 1:
            return Worker(worker_id, copy.deepcopy(template).to(self.device), config.inner, stream, **options)
        from adloco.workers.sharded import ShardedWorker, sharded_copy  # FSDP2's import costs a second

        mesh = self.comm.shard_mesh  # type: ignore[attr-defined]
        return ShardedWorker(
            worker_id,
            sharded_copy(template, mesh, self.device),  # never whole on the device
            config.inner,
            stream,
            mesh=mesh,
            sum_over_shards=self.comm.sum_over_shards,
            **options,
        )

    def full_theta(self, trainer: Trainer) -> list[torch.Tensor]:
        """The trainer's whole θ where rank 0 evaluates it (collective over the shards of sharded workers)."""
        return self.comm.gather_shards(trainer.theta, self.param_shapes)

    def owner(self, worker_id: int) -> Trainer:
        return next(t for t in self.trainers.values() if worker_id in t.worker_ids)

    # -- the batch policy's side of the round (batch/rounds.py)
    def plans(self) -> dict[int, MicroBatchPlan]:
        return self.batches.plans()

    def samples_per_step(self) -> dict[int, int]:
        return self.batches.samples_per_step()

    def tokens_per_step(self) -> int:
        return self.batches.tokens_per_step()

    def inner_steps_per_round(self) -> int:
        return self.batches.inner_steps_per_round()

    def run_round(
        self,
        round_index: int,
        steps: int,
        lr_at: Callable[[int], float],
        on_step: Callable[[StepProgress], None] | None = None,
        first_step: int = 0,
        ask: Callable[[], BoundaryRequest] = BoundaryRequest,
        tokens_left: int | None = None,
    ) -> RoundReport:
        """H inner steps on every hosted worker, with the strategy's exchanges where it wants them, then the
        round boundary: outer steps, batch decisions and, where ranks host different trainers, their state.
        ``ask`` says what this rank wants of the boundary; it is read before each report leaves the rank.
        ``tokens_left`` (the budget after this round) bounds how far a time-aware controller grows b."""
        started = time.perf_counter()
        between = started - self.ended  # NaN in a process's first round
        ask = self._asked_by_every_shard(ask)
        state = RoundState(round_index, steps, first_step, self.batches.statistics_due(round_index),
                           self.inner_steps_per_round())  # fmt: skip
        state.local = {w: WorkerRound(b_max=self.b_max[w]) for w in self.workers}
        # The plan (samples per step) is fixed for the round: every rank counts the same budget without asking.
        round_samples = self.samples_per_step()
        samples = {w: round_samples[w] for w in self.workers}
        state.weights = self.batches.sample_weights(round_samples)
        planned_tokens = sum(round_samples.values()) * self.context  # tokens_per_step() of this plan
        lr_scale = {w: self.owner(w).batch.lr_scale for w in self.workers}  # b_req holds still through a round
        for trainer in self.trainers.values():
            trainer.couple_inner_optimizers(self.workers)
        for step in range(steps):
            lr = lr_at(step)
            self.engine.compute(state, step, samples)
            state.stamp(ask())
            stepping = self.sync.after_backward(state, step)
            self.engine.step_workers(state, stepping, {w: lr * lr_scale[w] for w in self.workers})
            self.sync.after_inner_step(state, step)
            if on_step is not None:
                on_step(StepProgress(step=step, lr=lr, loss=_local_loss(state, step), tokens=planned_tokens))
        state.stamp(ask())
        self._time_alike_on_every_shard(state)
        state.stamp_seconds(self.overhead_seconds, self.between_seconds)
        sync = self._boundary(state, round_samples, tokens_left)
        self.ended = time.perf_counter()
        self.overhead_seconds = max(0.0, self.ended - started - sum(state.compute_seconds.values()))
        self.between_seconds = between  # reported with this round's overhead, in the next round
        report = self._report(state)
        report.sync = sync.to_dict()
        return report

    def _boundary(self, state: RoundState, round_samples: dict[int, int], tokens_left: int | None) -> SyncDecision:
        """The round boundary (``RoundEnd``): exchanges and outer steps, the workers' dispersion, batch decisions,
        every trainer's state on every rank, the costs learned and the next round's H."""
        self.batches.round_samples = round_samples
        config = self.config
        self.batches.lr_ratio = lr_ratio(config.inner, config.total_tokens, state.first_step + state.steps, tokens_left)
        self.batches.tokens_left = tokens_left
        return self.round_end(state, self.batches, self.batches)

    # A sharded worker's ranks are in different shard groups, each with its own round exchange: whatever a rank
    # measures by itself (signals, clocks) is made the same on all shards first, or the groups would decide apart.
    def _asked_by_every_shard(self, ask: Callable[[], BoundaryRequest]) -> Callable[[], BoundaryRequest]:
        if self.comm.shards == 1:
            return ask

        def agreed() -> BoundaryRequest:
            request = ask()
            largest = self.comm.max_over_shards(torch.tensor([request.stop_signal, float(request.checkpoint)]))
            return BoundaryRequest(stop_signal=int(largest[0]), checkpoint=bool(largest[1]))

        return agreed

    def _time_alike_on_every_shard(self, state: RoundState) -> None:
        """Each hosted worker's compute seconds and this rank's overhead and time between rounds: their means over
        the shards."""
        if self.comm.shards == 1:
            return
        hosted = sorted(self.workers)
        mine = [state.compute_seconds[w] for w in hosted] + [self.overhead_seconds, self.between_seconds]
        mean = self.comm.sum_over_shards(torch.tensor(mine, dtype=torch.float64)) / self.comm.shards
        state.compute_seconds.update(zip(hosted, mean[:-2].tolist(), strict=True))
        self.overhead_seconds, self.between_seconds = float(mean[-2]), float(mean[-1])

    def _report(self, state: RoundState) -> RoundReport:
        """The round in numbers, from every worker's report (so every rank writes the same)."""
        report = RoundReport(steps=state.steps, tokens=0)
        for step in range(state.steps):
            losses = {}
            for k, trainer in self.trainers.items():
                healthy = [state.reports[w].steps[step] for w in trainer.worker_ids]
                finite = [s.loss for s in healthy if s.finite]
                losses[k] = sum(finite) / len(finite) if finite else math.nan
            report.step_loss.append(losses)
            report.step_tokens.append(sum(r.steps[step].tokens for r in state.reports.values()))
        report.tokens = sum(report.step_tokens)
        report.loss = {k: sum(losses[k] for losses in report.step_loss) / state.steps for k in self.trainers}
        report.failed = sorted(w for w, r in state.reports.items() if r.failed)
        report.request = state.boundary_request()
        # A trainer made no progress when, at some step, none of its workers had a finite step.
        report.skipped = [
            k
            for k, t in self.trainers.items()
            if any(not any(state.reports[w].steps[s].finite for w in t.worker_ids) for s in range(state.steps))
        ]
        if state.statistics_due:
            records = {k: t.batch.decision_record() for k, t in self.trainers.items()}
            report.batch = {k: record for k, record in records.items() if record is not None}
        return report

    def flush(self) -> None:
        """Apply every exchange still in flight (end of training)."""
        self.sync.flush()

    @property
    def peak_sync_bytes(self) -> int:
        return self.sync.peak_sync_bytes

    # -- the parts that are not the round's: trainers across ranks and merges (trainers.py), checkpoint
    # state composed from the parts' own (state.py)
    def maybe_merge(self, round_index: int) -> MergeEvent | None:
        return trainer_sync.maybe_merge(self.comm, self.trainers, self.workers, self.config.merge, round_index)

    def state_dict(self) -> dict | None:
        return cluster_state.state_dict(self)

    def local_state_dict(self) -> dict:
        return cluster_state.local_state_dict(self)

    def shared_state(self) -> dict:
        return cluster_state.shared_state(self)

    def load_state_dict(self, state: dict) -> None:
        cluster_state.load_state_dict(self, state)


def lr_ratio(inner: InnerConfig, total_tokens: int, next_step: int, tokens_left: int | None) -> float:
    """The inner lr at the next round's start over its peak; 1.0 during the warm-up. The schedule decays over the
    run's ``total_tokens``, of which ``tokens_left`` remain."""
    if next_step < inner.warmup_steps:
        return 1.0
    done = 0.0 if tokens_left is None else 1.0 - tokens_left / total_tokens
    return inner_lr(next_step, done, inner.lr, inner.min_lr, inner.warmup_steps) / inner.lr


def shard_view(comm: Communicator, shards: int) -> Communicator:
    """``comm`` among the ranks that hold the same shard of every worker; ``comm`` itself for unsharded workers."""
    if shards == 1:
        return comm
    if not hasattr(comm, "shard_view"):
        raise ConfigError(f"shards: a worker sharded over {shards} ranks needs torchrun, one process per rank")
    try:
        return comm.shard_view(shards)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _restart(workers: dict[int, Worker], state: RoundState) -> None:
    for worker_id in state.out:
        workers[worker_id].reset_optimizer()  # restarts from θ with fresh AdamW moments


def _cross_worker(comm: Communicator, workers: dict[int, Worker], trainer: Trainer) -> GradientStatistics:
    return trainer.cross_worker_statistics(comm, workers)


def _shard_sum(comm: Communicator) -> ShardSum | None:
    """Sums over the ranks that hold the other shards of this rank's workers (None: the workers are whole)."""
    if comm.shards == 1:
        return None

    def summed(worker_sq: list[float], mean_sq: float) -> tuple[list[float], float]:
        total = comm.sum_over_shards(torch.tensor([mean_sq, *worker_sq], dtype=torch.float64)).tolist()
        return total[1:], total[0]

    return summed


def _local_loss(state: RoundState, step: int) -> float:
    finite = [r.steps[step].loss for r in state.local.values() if r.steps[step].finite]
    return sum(finite) / len(finite) if finite else math.nan
