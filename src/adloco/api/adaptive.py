"""AdLoCo's adaptive batch in a user's own loop: the batch of the next round, measured from the loop's own loss.

``DiLoCo(..., method="adloco")`` holds one: each round it tells the loop how many samples an inner step reads
and in which micro-batches (switch mode), runs the loop's loss over the groups of the round's first step (the
microbatch estimator: two scalars per worker, carried by the round's own exchange), and at the round's end
decides the next batch with the very policy ``adloco train`` runs (``adloco.batch``). The inner lr and AdamW β2 of
the user's optimizer follow the batch.

A worker sharded over several ranks (FSDP2) splits its step as ``adloco train shards=S`` does: every rank of the
worker reads the worker's whole batch (the same samples: the sampler's seed is the worker's), and ``backward`` runs
this rank's share of each micro-batch and of each statistics group, weighted by its share of the worker's batch.
A statistics group then spans the shards, so the worker's statistics are those of its whole gradient; its timings
are the mean over its ranks, so every rank of the worker decides the same b.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from adloco.algorithms.batch_tests import GroupedGradient
from adloco.algorithms.controller import StepCost, fit_step_cost
from adloco.algorithms.flat import flatten, unflatten
from adloco.algorithms.sharding import local_rows, sharded_like
from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches, split_evenly
from adloco.api.rounds import LoopRounds
from adloco.api.worker import WorkerShards
from adloco.batch.pace import CostModel, Pace, pinned_costs
from adloco.batch.policy import TrainerBatch, pace_for
from adloco.cluster.batches import pinned_seconds
from adloco.config import BatchConfig, ConfigError
from adloco.data.windows import TokenWindows, WindowSampler
from adloco.sync import RoundState, WorkerRound
from adloco.sync.trainer import Trainer
from adloco.workers.sharded import backward_shard
from adloco.workers.worker import backward_in_groups, backward_in_micro_batches


class AdaptiveBatch:
    """One rank's view of its trainer's adaptive batch (each rank is one worker of one trainer, or one rank of a
    worker sharded over several).

    ``samples``: what the coming inner step reads; ``plan``: the round's micro-batches; ``backward(loss_fn,
    *tensors)``: the step's backward over those samples, in micro-batches and, on a statistics step, in groups;
    ``sampler(n)``: a ``torch.utils.data`` batch sampler that reads ``samples`` indices per step.
    """

    def __init__(
        self,
        batch: BatchConfig,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        trainers: Mapping[int, Trainer],
        worker_id: int,
        rounds: LoopRounds,
        total_samples: int | None = None,
        shards: WorkerShards | None = None,
        divisor: float = 1.0,
    ) -> None:
        _check_supported(batch)
        self.config, self.optimizer, self.params = batch, optimizer, list(params)
        # the ranks of this rank's worker when its model is sharded over several, and what FSDP divides their
        # gradients' sum by (each rank's share of a step is scaled by it, so the reduction gives the worker's mean)
        self.shards, self.divisor = shards, divisor
        self.trainers, self.worker_id = trainers, worker_id  # the loop's own dict: merges remove trainers from it
        self.total_workers = sum(len(t.worker_ids) for t in trainers.values())
        self.rounds, self.total_samples = rounds, total_samples  # rounds: their H (auto: b weighed at the H chosen)
        self.b_max = batch.memory.b_max or batch.b_cap  # no probe of the user's model: given, or the test's cap
        self.costs = _pinned_costs(batch, self.total_workers)
        self.samples_done = 0  # samples the rounds that ended read, over every worker (the budget's count)
        # samples each worker (of every trainer) reads in those rounds, as planned: where a replica that heals
        # moves its data stream to, whichever peer's state it healed from
        self.samples_by_worker: dict[int, int] = {}
        self.base_beta2 = [group["betas"][1] if "betas" in group else None for group in optimizer.param_groups]
        self.plans = self._plans()
        self.statistics_due = False
        self.first_step = True  # of the round in progress
        # inner steps of the round in progress (the budget's count within a round); at its end, as stamp() sets
        # them, the steps decide() and learn() count
        self.round_steps = 0
        self.statistics = None
        self.compute_seconds = 0.0
        self._round_started = time.perf_counter()
        self._lrs: list[float] | None = None

    @property
    def trainer(self) -> Trainer:
        """The trainer this rank's worker belongs to (another one after a merge)."""
        return next(t for t in self.trainers.values() if self.worker_id in t.worker_ids)

    @property
    def policy(self) -> TrainerBatch:
        """b_req and what moves it: this worker's trainer's (``adloco.batch``'s ``TrainerBatch``)."""
        return self.trainer.batch

    @property
    def plan(self) -> MicroBatchPlan:
        """The round's micro-batches on this rank."""
        return self.plans[self.trainer.trainer_id]

    def _plans(self) -> dict[int, MicroBatchPlan]:
        return {
            k: plan_micro_batches(t.batch.size, self.b_max, self.config.memory.switch_factor)
            for k, t in self.trainers.items()
        }

    # -- the round -----------------------------------------------------------------------------------------------
    def start_round(self, round_index: int) -> None:
        """A round begins: its plan, whether its first step measures, and β2 for its batch (b holds still)."""
        self.statistics_due = round_index % self.config.statistics.every == 0
        self.first_step, self.statistics, self.compute_seconds = True, None, 0.0
        self.round_steps = 0
        self._round_started = time.perf_counter()
        self._follow_batch()

    def _follow_batch(self) -> None:
        self.plans = self._plans()
        for group, base in zip(self.optimizer.param_groups, self.base_beta2, strict=True):
            if base is not None:
                group["betas"] = (group["betas"][0], self.policy.beta2(base))

    @property
    def size(self) -> int:
        """b_req: the samples per worker per inner step the batch test asks for."""
        return self.policy.size

    @property
    def measuring(self) -> bool:
        """Whether the coming step is the round's statistics step (its samples split into groups)."""
        return self.statistics_due and self.first_step

    @property
    def samples(self) -> int:
        """Samples the coming inner step reads on this rank: the plan's (at least 2 on a statistics step)."""
        return max(self.plan.samples, 2) if self.measuring else self.plan.samples

    @property
    def lr_scale(self) -> float:
        """The factor on the inner lr at the current batch (applied around each optimizer step)."""
        return self.policy.lr_scale

    def backward(self, loss_fn: Callable[..., torch.Tensor], *data: torch.Tensor) -> float:
        """The step's gradient, the mean over the samples in ``data`` (first dimension), in micro-batches of at
        most b_max: ``loss_fn(*slices)`` is the mean loss of the samples in ``slices``. On the round's statistics
        step the samples are split into groups whose gradients give the batch test its statistics. The mean
        loss."""
        begun = time.perf_counter()
        batch = data[0].size(0)
        if self.shards is not None:
            self._check_same_samples(data[0])

        def loss_of(offset: int, size: int) -> torch.Tensor:
            return loss_fn(*(t[offset : offset + size] for t in data))

        if not self.measuring:
            loss = self._backward_samples(loss_of, 0, batch, batch)
        else:
            loss = self._measured_backward(loss_of, batch)
        self.first_step = False
        self.compute_seconds += time.perf_counter() - begun
        return loss

    def _backward_samples(
        self, loss_of: Callable[[int, int], torch.Tensor], start: int, stop: int, total: int
    ) -> float:
        """The backward of samples [start, stop), each weighing 1/``total``: on this rank, or this rank's share of
        them when the worker is sharded; the worker's mean loss over them."""
        if self.shards is None:
            return float(backward_in_micro_batches(loss_of, start, stop, total, self.b_max))
        shard = (self.shards.index, self.shards.count)
        return backward_shard(loss_of, start, stop, total, self.b_max, self.divisor, shard, self.shards.sum_tensor)

    def _check_same_samples(self, samples: torch.Tensor) -> None:
        """The ranks of a sharded worker split one batch: refuse (on all of them at once) where they were given
        different ones, which would train the worker on neither (or hang FSDP on unlike micro-batch counts)."""
        assert self.shards is not None
        if not self.shards.hold_alike(samples):
            raise ValueError("the ranks of a sharded worker read different samples for one inner step: with "
                             "method='adloco' every rank of a worker reads the worker's whole batch (the same "
                             "sampler seed) and backward() runs its own share")  # fmt: skip

    def _measured_backward(self, loss_of: Callable[[int, int], torch.Tensor], batch: int) -> float:
        sizes = split_evenly(batch, min(batch, self.config.statistics.groups))
        gram = self.config.test == "inner_product"
        rows = [local_rows(p) for p in self.params]
        grouped = GroupedGradient(sizes, sum(r.numel() for r in rows), gram, rows[0].device)

        def backward_group(start: int, size: int) -> list[float]:
            for p in self.params:
                p.grad = None
            loss = self._backward_samples(loss_of, start, start + size, size)
            pairs = zip(self.params, rows, strict=True)
            grads = [torch.zeros_like(r) if p.grad is None else local_rows(p.grad) for p, r in pairs]
            grouped.add(flatten(grads), size)
            return [loss]

        (loss,) = backward_in_groups(sizes, backward_group)
        with torch.no_grad():
            for p, g in zip(self.params, unflatten(grouped.total, rows), strict=True):
                p.grad = sharded_like(p, g.to(local_rows(p).device, copy=True))
        self.statistics = grouped.statistics(None if self.shards is None else self.shards.sum_tensor)
        return loss

    def scale_lr(self) -> None:
        """Before the optimizer step: the inner lr × the batch's factor (the loop's own schedule stays its own)."""
        self._lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * self.lr_scale

    def restore_lr(self) -> None:
        if self._lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self._lrs, strict=True):
                group["lr"] = lr
            self._lrs = None

    def after_step(self, record: WorkerRound) -> None:
        """The optimizer step is done: the loop's lr back, and a statistics step's measurement into the worker's
        round report (a non-finite step measured nothing), which the round's exchange carries to every rank."""
        self.restore_lr()
        self.first_step = False
        self.round_steps = len(record.steps)
        if self.statistics is not None and record.steps and record.steps[-1].finite and not record.out:
            record.statistics = self.statistics
        self.statistics = None

    def stamp(self, state: RoundState, rank: int, steps: int) -> None:
        """The round ends after ``steps`` inner steps: this worker's timings into its round report (a time-aware
        controller's measured costs)."""
        self.round_steps = steps
        record = state.local[rank]
        step_seconds = self.compute_seconds / max(steps, 1)
        overhead = max(0.0, time.perf_counter() - self._round_started - self.compute_seconds)
        if self.shards is not None:  # the worker's, the same on each of its ranks: they must decide alike
            step_seconds, overhead = (t / self.shards.count for t in self.shards.sum([step_seconds, overhead]))
        record.step_seconds, record.overhead_seconds = step_seconds, overhead

    def decide(self, state: RoundState, trainers: Sequence[Trainer]) -> None:
        """The round's end (the reports of the ``trainers`` taking part here in): each decides its next batch, alike
        on every rank of it (every trainer on a fault-tolerant replica, which holds every trainer's reports)."""
        steps = self.round_steps
        reports = {w: state.reports[w] for t in trainers for w in t.worker_ids}
        if self.costs is None and self.config.controller == "time":
            samples = {w: self.plans[t.trainer_id].samples for t in trainers for w in t.worker_ids}
            self.costs = _measured_costs(self.config, reports, samples)
        if not state.statistics_due:
            return
        planned = self.samples_done + steps * self.job_samples  # the budget left after this round as planned
        left = None if self.total_samples is None else self.total_samples - planned
        for trainer in trainers:
            present = [reports[w] for w in trainer.worker_ids if not reports[w].absent]  # an absent one measured none
            if present:
                trainer.batch.decide_from_reports(present, self._pace(trainer, left))

    def _pace(self, trainer: Trainer, left: int | None) -> Pace | None:
        """What a time-aware decision weighs, at the round's H (``sync_every=auto``: b and H chosen together, as
        adloco train's)."""
        rounds = self.rounds
        return pace_for(self.config, self.costs, trainer.worker_ids, rounds.length, left, 1, self.total_workers,
                        rounds.auto, rounds.ratio(rounds.lr()))  # fmt: skip

    def pinned_seconds(self) -> tuple[float, float] | None:
        """(t, c) as ``batch.time.step_seconds`` and ``round_seconds`` pin them, both given (one worker a rank),
        t at the b each trainer just decided (the coming round's, as adloco train's); None where either is
        measured."""
        plans = self._plans()
        samples = {w: plans[k].samples for k, t in self.trainers.items() for w in t.worker_ids}
        return pinned_seconds(self.costs, samples, {w: w for w in samples})

    def learn(self, state: RoundState) -> None:
        """After every trainer's reports reached every rank: the samples the round read (the budget) and the
        costs they measured."""
        steps = self.round_steps
        for k, t in self.trainers.items():  # as the plans say, so every rank counts alike; an absent worker read none
            extra = max(self.plans[k].samples, 2) - self.plans[k].samples if state.statistics_due and steps else 0
            present = sum(not state.reports[w].absent for w in t.worker_ids)
            self.samples_done += (steps * self.plans[k].samples + extra) * present
            for w in t.worker_ids:
                self.samples_by_worker[w] = self.samples_by_worker.get(w, 0) + steps * self.plans[k].samples + extra
        if self.costs is not None:
            reports = {w: state.reports[w] for t in self.trainers.values() for w in t.worker_ids}
            reports = {w: r for w, r in reports.items() if not r.absent}
            samples = {w: self.plans[k].samples for k, t in self.trainers.items() for w in t.worker_ids}
            unmet = {w: r for w, r in reports.items() if w not in self.costs.base}  # another trainer's workers
            if unmet:
                self.costs.include(_measured_costs(self.config, unmet, samples).base)
            self.costs.learn(reports, samples)

    @property
    def job_samples(self) -> int:
        """Samples one inner step of the round reads over every worker of every trainer, as the plans say (a step of
        the budget, not a total; a statistics step reads more where b < 2)."""
        return sum(self.plans[k].samples * len(t.worker_ids) for k, t in self.trainers.items())

    @property
    def samples_read(self) -> int:
        """Samples the job has read so far over every worker of every trainer: the rounds that ended
        (``samples_done``) and the steps of the round in progress, as planned (each worker reads the plan's samples a
        step, a statistics step at least 2). What a loop that stops on a budget compares with it."""
        extra = self.statistics_due and self.round_steps > 0
        in_round = sum(
            (self.round_steps * self.plans[k].samples + (max(self.plans[k].samples, 2) - self.plans[k].samples) * extra)
            * len(t.worker_ids)
            for k, t in self.trainers.items()
        )
        return self.samples_done + in_round

    @property
    def last_decision(self) -> dict | None:
        """The last round's batch test and controller decision, as ``adloco train`` logs them."""
        return self.policy.decision_record()

    # -- data ----------------------------------------------------------------------------------------------------
    def sampler(self, dataset: int | TokenWindows, seed: int = 0, shuffle: bool = True) -> BatchSampler | WindowSampler:
        """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) whose every batch is the coming step's
        ``samples`` indices; epochs follow one another without end.

        ``dataset``: a size, for a dataset of that many samples: give each worker its own ``seed`` (the ranks of a
        sharded worker the same one: they read the worker's whole batch). Or token files' ``TokenWindows``: every
        worker the same ``seed``; each reads its own positions of one window order (disjoint within an epoch,
        as ``adloco train`` reads them), and the sampler's state is a counter."""
        if isinstance(dataset, TokenWindows):
            if not shuffle:
                raise ValueError("token windows are read in the run's keyed order; shuffle=False does not apply")
            return WindowSampler(len(dataset), seed, self.worker_id, self.total_workers, lambda: self.samples)
        return BatchSampler(self, dataset, seed, shuffle)

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The costs and the budget spent (b and its controllers are the trainer's, in its own state)."""
        return {
            "costs": None if self.costs is None else self.costs.state_dict(),
            "samples_done": self.samples_done,
            "samples_by_worker": dict(self.samples_by_worker),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["costs"] is not None:
            base = {int(w): StepCost(*c) for w, c in state["costs"]["base"].items()}
            self.costs = self.costs or CostModel(
                base, self.config.time.step_seconds is None, self.config.time.round_seconds
            )
            self.costs.load_state_dict(state["costs"])
        self.samples_done = int(state["samples_done"])
        self.samples_by_worker = {int(w): int(n) for w, n in state["samples_by_worker"].items()}

    @property
    def worker_samples(self) -> int:
        """Samples this rank's worker read in the rounds that ended, as planned (a replica's stream position)."""
        return self.samples_by_worker.get(self.worker_id, 0)


class NoAdaptiveBatch:
    """``diloco.batch`` of a DiLoCo without AdLoCo's adaptive batch: false in a test, and any use of it one clear
    error (rather than Python's on None)."""

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like ask for these: they are simply absent
            raise AttributeError(name)
        raise AttributeError(
            f"diloco.batch.{name}: diloco.batch is AdLoCo's adaptive batch, which this DiLoCo has none of; build it "
            "with method='adloco' (or a batch={...} section), or run the loop's own backward"
        )

    def __repr__(self) -> str:
        return "NoAdaptiveBatch()"


NO_BATCH = NoAdaptiveBatch()


class BatchSampler(torch.utils.data.Sampler):
    """Index lists of the size the adaptive batch asks for at each step, over shuffled epochs of a dataset (each
    epoch's order from ``seed`` and its number, so ``state_dict`` resumes the order exactly). It asks when the
    loader asks for the next batch: use it with ``num_workers=0``, or a prefetching loader reads ahead of b."""

    def __init__(self, batch: AdaptiveBatch, dataset_size: int, seed: int, shuffle: bool) -> None:
        if dataset_size < 1:
            raise ValueError("the dataset is empty")
        self.batch, self.dataset_size, self.seed, self.shuffle = batch, dataset_size, seed, shuffle
        self.epoch, self.position = 0, 0  # indices of the epoch already handed out
        self._order: tuple[int, list[int]] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            indices: list[int] = []
            want = self.batch.samples
            while len(indices) < want:  # a step may span an epoch's end: the next epoch follows on
                taken = self._epoch_order()[self.position : self.position + want - len(indices)]
                indices += taken
                self.position += len(taken)
                if self.position == self.dataset_size:
                    self.epoch, self.position = self.epoch + 1, 0
            yield indices

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                order = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                order = list(range(self.dataset_size))
            self._order = (self.epoch, order)
        return self._order[1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _check_supported(batch: BatchConfig) -> None:
    if batch.statistics.estimator != "microbatch":
        raise ConfigError(
            "batch.statistics.estimator: a user's loop measures with 'microbatch' (cross_worker is adloco train's)"
        )
    if batch.shares != "equal" or batch.time.keep_round_time:
        raise ConfigError("batch: shares=speed and time.keep_round_time are adloco train's (one worker per rank here)")


def _pinned_costs(batch: BatchConfig, world_size: int) -> CostModel | None:
    """Step costs pinned in ``batch.time.step_seconds`` (a worker per rank), or None: measured after the first
    round."""
    if batch.controller != "time":
        return None
    pinned = batch.time.step_seconds
    if isinstance(pinned, list) and len(pinned) != world_size:
        raise ConfigError(f"batch.time.step_seconds: {len(pinned)} workers given, the job has {world_size}")
    return pinned_costs(batch.time, range(world_size))


def _measured_costs(batch: BatchConfig, reports: Mapping[int, WorkerRound], samples: Mapping[int, int]) -> CostModel:
    """Each worker's step cost from the first round's own steps (proportional to b until later rounds correct it);
    a worker absent from that round (a replica that died) is taken as slow as the slowest worker present."""
    base = {}
    for w, report in reports.items():
        seconds = report.step_seconds if math.isfinite(report.step_seconds) else 0.0
        base[w] = fit_step_cost([(samples[w], seconds)])
    present = [base[w] for w, report in reports.items() if not report.absent]
    for w in (w for w, report in reports.items() if report.absent and present):
        base[w] = max(present, key=lambda cost: (cost.per_sample, cost.overhead))
    return CostModel(base, True, batch.time.round_seconds)
