"""All trainers and their workers: placement of worker slots, one round of training, merges."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.futures import Future

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.algorithms.codecs import ErrorFeedback, get_codec
from adloco.algorithms.fragments import assign_fragments
from adloco.algorithms.merge import merge_weights, merged_batch_size, select_merge_group, weighted_average
from adloco.algorithms.outer import worker_delta
from adloco.algorithms.schedules import fragments_sending_at
from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches
from adloco.comm.base import Communicator
from adloco.config import ConfigError, TrainConfig
from adloco.probe import CudaMemoryMeter, MemoryMeter, ProcessMemoryMeter, probe_b_max, training_step_at
from adloco.tasks import Task
from adloco.trainer import Trainer
from adloco.worker import EagerCopy, Worker

log = logging.getLogger(__name__)

# Worker seeds are spread far apart so streams of different workers never share a generator state.
_STREAM_SEED_STRIDE = 1_000_003


@dataclass
class MergeEvent:
    round: int
    merged: list[int]
    into: int
    weights: list[float]
    batch_size: int
    workers: list[int]

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass
class StepReport:
    step: int
    lr: float
    loss: dict[int, float]
    tokens: int


@dataclass
class RoundReport:
    steps: int
    tokens: int
    loss: dict[int, float] = field(default_factory=dict)
    batch: dict[int, dict] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    ddp_failed: set[int] = field(default_factory=set)


def rank_placement(total_workers: int, world_size: int, slots_per_rank: int | None) -> dict[int, int]:
    """Which rank hosts each worker slot: contiguous blocks of ``slots_per_rank`` worker ids per rank."""
    slots = slots_per_rank or total_workers // world_size
    if slots * world_size != total_workers:
        raise ConfigError(
            f"slots_per_rank: {total_workers} workers do not fill {world_size} ranks"
            + (f" with {slots_per_rank} slots each" if slots_per_rank else " evenly")
        )
    return {w: w // slots for w in range(total_workers)}


def placement(trainers: int, workers_per_trainer: int) -> dict[int, list[int]]:
    """Worker ids of each trainer at the start: trainer k owns workers k·M … k·M + M − 1."""
    return {k: list(range(k * workers_per_trainer, (k + 1) * workers_per_trainer)) for k in range(trainers)}


def resolve_b_max(
    config: TrainConfig, model: torch.nn.Module, context: int, vocab_size: int, task: Task | None = None
) -> int:
    """b_max from the config, or probed with real steps (of ``task``'s batches and loss): on CUDA under
    ``memory_fraction`` of the device, on CPU under ``memory_budget_mb`` of process memory (without a budget
    a CPU worker is limited by b_cap)."""
    batch = config.batch
    if batch.b_max is not None:
        return batch.b_max
    device = next(model.parameters()).device
    meter: MemoryMeter
    if device.type == "cuda":
        cuda = CudaMemoryMeter(device)
        meter, budget = cuda, int(batch.memory_fraction * cuda.capacity_bytes())
    elif batch.memory_budget_mb is not None:
        meter, budget = ProcessMemoryMeter(), int(batch.memory_budget_mb * 2**20)
    else:
        return batch.b_cap
    found = probe_b_max(training_step_at(model, context, vocab_size, task), meter, budget, upper=batch.b_cap)
    if found == 0:
        raise ConfigError(f"batch: not even one sample fits in {budget / 2**20:.0f} MiB at context {context}")
    log.info("b_max probe on %s: %d samples per micro-batch fit in %.0f MiB", device, found, budget / 2**20)
    return found


class Cluster:
    """The trainers and the worker slots this rank hosts; every rank runs the same rounds in lockstep."""

    def __init__(
        self,
        config: TrainConfig,
        task: Task,
        comm: Communicator,
        device: torch.device | None = None,
    ) -> None:
        assert config.trainers is not None and config.sync_every is not None
        self.config = config
        self.comm = comm
        self.task = task
        self.context = task.context
        batch = config.batch
        self.collect_statistics = config.method == "adloco" or batch.test != "constant"
        self.device = device or torch.device("cpu")
        b_max = None
        self.trainers: dict[int, Trainer] = {}
        self.workers: dict[int, Worker] = {}
        layout = placement(config.trainers, config.workers)
        self.worker_rank = rank_placement(config.total_workers, comm.world_size, config.slots_per_rank)
        comm.set_placement(self.worker_rank)
        codec = None if config.codec.name == "none" else get_codec(config.codec.name, config.codec.block_size)
        self.streaming = config.method == "streaming"
        fragments = None
        for trainer_id, worker_ids in layout.items():
            init_seed = config.seed if config.merge.shared_init else config.seed + trainer_id
            template = task.build_model(init_seed)
            if b_max is None:
                b_max = resolve_b_max(config, template.to(self.device), self.context, task.vocab_size, task)
                template = template.cpu()
            if self.streaming and fragments is None:
                names = [name for name, _ in template.named_parameters()]
                stream_config = config.streaming
                try:
                    fragments = assign_fragments(
                        names, stream_config.fragments, stream_config.assignment, stream_config.shared
                    )
                except ValueError as error:
                    raise ConfigError(str(error)) from None
            controller = BatchSizeController(
                test=batch.test,
                eta=batch.eta,
                theta=batch.theta,
                nu=batch.nu,
                ema=batch.ema,
                b_min=batch.b_min,
                b_cap=batch.b_cap,
                allow_shrink=batch.allow_shrink,
            )
            self.trainers[trainer_id] = Trainer(
                trainer_id,
                [p.detach() for p in template.parameters()],
                worker_ids,
                batch_size=batch.size,
                outer_lr=config.outer.lr,
                outer_momentum=config.outer.momentum,
                nesterov=bool(config.outer.nesterov),
                controller=controller,
                fragments=fragments,
                codec=codec,
            )
            comm.register_group(worker_ids)
            for worker_id in worker_ids:
                if self.worker_rank[worker_id] != comm.rank:
                    continue
                seed = config.seed * _STREAM_SEED_STRIDE + worker_id
                stream = task.stream(seed, worker=worker_id, workers=config.total_workers)
                self.workers[worker_id] = Worker(
                    worker_id,
                    copy.deepcopy(template).to(self.device),
                    config.inner,
                    stream,
                    b_max,
                    batch.switch_factor,
                    loss_fn=task.loss,
                )
                if codec is not None and config.codec.error_feedback:
                    self.workers[worker_id].error_feedback = ErrorFeedback()
            self.trainers[trainer_id].broadcast(self.workers)
            if config.outer.overlap == "eager":
                for worker_id in worker_ids:
                    if worker_id in self.workers:
                        self.workers[worker_id].eager = EagerCopy(
                            self.trainers[trainer_id].theta,
                            config.outer.lr,
                            config.outer.momentum,
                            bool(config.outer.nesterov),
                        )
        self.param_names = [name for name, _ in template.named_parameters()]
        # Exchanges in flight: (trainer, fragment) -> (step at which to apply, future of Δ). Streaming applies
        # them τ steps after sending; outer.overlap applies fragment 0 (all of θ) at the end of the next round.
        self.pending: dict[tuple[int, int], tuple[int, Future]] = {}
        self.peak_sync_bytes = 0
        # b_max is per worker device: every rank learns every worker's, so all plan the same token budget.
        shared = comm.gather_worker_scalars({w: [float(worker.b_max)] for w, worker in self.workers.items()})
        self.worker_b_max = {w: int(v[0]) for w, v in shared.items()}

    def worker_plan(self, worker_id: int, b_req: int) -> MicroBatchPlan:
        return plan_micro_batches(b_req, self.worker_b_max[worker_id], self.config.batch.switch_factor)

    def plans(self) -> dict[int, MicroBatchPlan]:
        """Each trainer's switch-mode plan for its current b_req (on its first worker's device)."""
        return {k: self.worker_plan(t.worker_ids[0], t.batch_size) for k, t in self.trainers.items()}

    def tokens_per_step(self) -> int:
        """Tokens one inner step reads over all workers, following each worker's switch-mode plan."""
        samples = sum(self.worker_plan(w, t.batch_size).samples for t in self.trainers.values() for w in t.worker_ids)
        return samples * self.context

    def statistics_due(self, round_index: int) -> bool:
        return self.collect_statistics and round_index % self.config.batch.test_every == 0

    def run_round(
        self,
        round_index: int,
        steps: int,
        lr_at: Callable[[int], float],
        on_step: Callable[[StepReport], None] | None = None,
        first_step: int = 0,
    ) -> RoundReport:
        """H inner steps on every hosted worker, then each trainer's outer step and batch test."""
        config = self.config
        stats_due = self.statistics_due(round_index)
        cross_worker = stats_due and config.batch.estimator == "cross_worker"
        gram = config.batch.test == "inner_product"
        owner = {w: t for t in self.trainers.values() for w in t.worker_ids}
        report = RoundReport(steps=steps, tokens=0)
        loss_sums = {k: 0.0 for k in self.trainers}
        failed: set[int] = set()  # workers out of this round after a non-finite loss or gradient
        for step in range(steps):
            lr = lr_at(step)
            local: dict[int, list[float]] = {}
            for worker_id in sorted(self.workers):
                if worker_id in failed:
                    local[worker_id] = [math.nan, 0.0, 0.0]
                    continue
                trainer = owner[worker_id]
                result = self.workers[worker_id].compute_gradients(
                    trainer.batch_size,
                    stats_groups=config.batch.groups if (stats_due and step == 0 and not cross_worker) else None,
                    gram=gram,
                    keep_gradient=cross_worker and step == steps - 1,
                )
                if result.statistics is not None and result.finite:
                    trainer.record_statistics(worker_id, result.statistics)
                local[worker_id] = [result.loss, float(result.tokens), 1.0 if result.finite else 0.0]
            # Every rank learns every worker's loss, token count and health: all ranks then agree on the
            # budget and on who is left out.
            every = self.comm.gather_worker_scalars(local)
            step_failed = {w for w, values in every.items() if values[2] == 0.0}
            if step_failed - failed:
                log.warning("round %d step %d: non-finite values on workers %s", round_index, step, sorted(step_failed))
            self._apply_step(lr, step_failed, failed, report)
            if self.streaming:
                self._stream(first_step + step + 1, failed)
            losses = {}
            for k, t in self.trainers.items():
                healthy = [every[w][0] for w in t.worker_ids if w not in step_failed]
                losses[k] = sum(healthy) / len(healthy) if healthy else math.nan
                loss_sums[k] += losses[k]
            step_tokens = int(sum(v[1] for v in every.values()))
            report.tokens += step_tokens
            if on_step is not None:
                on_step(StepReport(step=step, lr=lr, loss=losses, tokens=step_tokens))
        report.failed = sorted(failed | report.ddp_failed)
        for trainer in self.trainers.values():
            report.loss[trainer.trainer_id] = loss_sums[trainer.trainer_id] / steps
            mine = set(trainer.worker_ids)
            if config.method != "ddp" and mine <= failed:
                report.skipped.append(trainer.trainer_id)
            if not any(w in self.workers for w in trainer.worker_ids):
                continue  # another rank's trainer: its state arrives in synchronize()
            if config.method == "ddp":
                trainer.adopt_worker_params(self.workers)
            elif trainer.trainer_id in report.skipped:
                log.warning(
                    "round %d: every worker of trainer %d failed; the round is skipped", round_index, trainer.trainer_id
                )
                if config.outer.overlap != "none":
                    self._overlapped_outer_step(trainer, mine, send=False)
                else:
                    trainer.broadcast(self.workers)
            elif config.outer.overlap != "none":
                self._overlapped_outer_step(trainer, failed & mine)
            elif not self.streaming:
                self._count_sync(trainer, 0)
                trainer.outer_step(self.comm, self.workers, excluded=failed & mine)
            for worker_id in failed & mine:
                if worker_id in self.workers:
                    self.workers[worker_id].reset_optimizer()  # restarts from θ with fresh AdamW moments
            if stats_due and failed & mine:
                trainer.pending_statistics = {}  # a partial measurement is not a measurement
            elif stats_due:
                statistics = (
                    trainer.cross_worker_statistics(self.comm, self.workers)
                    if cross_worker
                    else trainer.combine_statistics(self.comm)
                )
                if statistics is not None:
                    trainer.decide_batch(statistics)
        self.synchronize()
        if stats_due:
            report.batch = {
                k: t.last_decision.to_dict() for k, t in self.trainers.items() if t.last_decision is not None
            }
        return report

    def _apply_step(self, lr: float, step_failed: set[int], failed: set[int], report: RoundReport) -> None:
        """Optimizer steps. DDP leaves a failed worker out of the average only; the others leave it out of the round."""
        if self.config.method == "ddp":
            for trainer in self.trainers.values():
                if set(trainer.worker_ids) <= step_failed:
                    report.skipped.append(trainer.trainer_id)
                    report.ddp_failed |= step_failed
                    for worker_id in trainer.worker_ids:
                        if worker_id in self.workers:
                            self.workers[worker_id].optimizer.zero_grad(set_to_none=True)
                    continue
                trainer.average_gradients(self.comm, self.workers, excluded=step_failed)
                report.ddp_failed |= step_failed & set(trainer.worker_ids)
                for worker_id in trainer.worker_ids:
                    if worker_id in self.workers:
                        self.workers[worker_id].step(lr)
            return
        failed |= step_failed
        for worker_id in sorted(self.workers):
            if worker_id in failed:
                self.workers[worker_id].optimizer.zero_grad(set_to_none=True)
            else:
                self.workers[worker_id].step(lr)

    def _overlapped_outer_step(self, trainer: Trainer, excluded: set[int], send: bool = True) -> None:
        """Send this round's Δ without waiting for it; apply the one sent a round ago, which has had a whole
        round of compute to arrive. A skipped round (``send=False``) only applies what arrives."""
        key = (trainer.trainer_id, 0)
        arrived = self.pending.pop(key)[1].wait() if key in self.pending else None
        hosted = [w for w in trainer.worker_ids if w in self.workers]
        eager = {w: self.workers[w].eager for w in hosted if self.workers[w].eager is not None}
        fresh: dict[int, list[torch.Tensor]] = {}
        if send:
            bases = {w: copy.theta for w, copy in eager.items()} if eager else None
            self._count_sync(trainer, 0)
            future = trainer.send_fragment(0, self.comm, self.workers, excluded=excluded, bases=bases)
            self.pending[key] = (0, future)
            healthy = trainer.healthy_count(excluded)
            fresh = {
                w: [d.div_(healthy) for d in worker_delta(copy.theta, self.workers[w].params)]
                for w, copy in eager.items()
                if w not in excluded
            }
        trainer.apply_overlapped(arrived, fresh, self.workers)

    def _count_sync(self, trainer: Trainer, fragment: int) -> None:
        """Track the largest single exchange: every worker's payload for one fragment."""
        numel = sum(trainer.theta[i].numel() for i in trainer.fragments[fragment])
        per_worker = 4 * numel if trainer.codec is None else trainer.codec.encoded_nbytes(numel)
        self.peak_sync_bytes = max(self.peak_sync_bytes, per_worker * len(trainer.worker_ids))

    def _stream(self, step: int, failed: set[int]) -> None:
        """Streaming DiLoCo at global inner step ``step``: start due exchanges, apply those τ steps old."""
        stream = self.config.streaming
        assert stream.fragments is not None and stream.overlap is not None and stream.alpha is not None
        for trainer in self.trainers.values():
            for p in fragments_sending_at(step, self.config.sync_every, stream.fragments):
                self._count_sync(trainer, p)
                future = trainer.send_fragment(p, self.comm, self.workers, excluded=failed & set(trainer.worker_ids))
                self.pending[(trainer.trainer_id, p)] = (step + stream.overlap, future)
        for key in sorted(k for k, (due, _) in self.pending.items() if due <= step):
            _, future = self.pending.pop(key)
            self.trainers[key[0]].apply_fragment(key[1], future.wait(), self.workers, stream.alpha)

    def flush(self) -> None:
        """Apply every exchange still in flight (end of training)."""
        stream = self.config.streaming
        for key in sorted(self.pending):
            _, future = self.pending.pop(key)
            self.trainers[key[0]].apply_fragment(key[1], future.wait(), self.workers, stream.alpha or 0.0)

    def lead_rank(self, trainer: Trainer) -> int:
        return self.worker_rank[trainer.worker_ids[0]]

    def synchronize(self) -> None:
        """Give every rank every trainer's state, from the trainer's lead rank.

        Only needed when some rank hosts none of a trainer's workers (several trainers on several ranks):
        merges, evaluation and checkpoints then see the same trainers everywhere.
        """
        if self.comm.world_size == 1 or all(
            set(self.comm.ranks_of(t.worker_ids)) == set(range(self.comm.world_size)) for t in self.trainers.values()
        ):
            return
        for trainer in self.trainers.values():
            src = self.lead_rank(trainer)
            meta = self.comm.broadcast_object(trainer.sync_metadata() if self.comm.rank == src else None, src=src)
            if self.comm.rank != src:
                trainer.load_sync_metadata(meta)
            self.comm.broadcast_tensors(trainer.theta, src)
            buffers = trainer.momentum_buffers()
            if meta["has_momentum"]:
                if any(b is None for b in buffers):
                    trainer.set_momentum_buffers([torch.zeros_like(t) for t in trainer.theta])
                    buffers = trainer.momentum_buffers()
                self.comm.broadcast_tensors(buffers, src)

    def maybe_merge(self, round_index: int) -> MergeEvent | None:
        """Every ``merge.every`` rounds, merge the trainers with the smallest b_req into the first of them."""
        merge = self.config.merge
        if merge.policy == "off" or len(self.trainers) < 2 or (round_index + 1) % merge.every != 0:
            return None
        b_req = {k: t.batch_size for k, t in self.trainers.items()}
        group = select_merge_group(b_req, min(merge.group_size, len(self.trainers)))
        members = [self.trainers[k] for k in group]
        weights = merge_weights(merge.policy, [t.batch_size for t in members], [len(t.worker_ids) for t in members])
        theta = weighted_average([t.theta for t in members], weights)
        momentum = weighted_average([t.momentum_buffers() for t in members], weights)
        survivor = members[0]
        with torch.no_grad():
            for target, value in zip(survivor.theta, theta, strict=True):
                target.copy_(value)
        if survivor.momentum > 0:
            survivor.set_momentum_buffers(momentum)
        survivor.batch_size = merged_batch_size([t.batch_size for t in members])
        for other in members[1:]:
            survivor.worker_ids = sorted(survivor.worker_ids + other.worker_ids)
            del self.trainers[other.trainer_id]
        survivor.broadcast(self.workers)
        self.comm.register_group(survivor.worker_ids)
        event = MergeEvent(
            round=round_index,
            merged=group,
            into=survivor.trainer_id,
            weights=list(weights),
            batch_size=survivor.batch_size,
            workers=list(survivor.worker_ids),
        )
        log.info("merge: trainers %s into %d with weights %s", group, survivor.trainer_id, weights)
        return event

    def state_dict(self) -> dict | None:
        """The whole cluster's state on rank 0 (None on other ranks); every rank must call it."""
        gathered = self.comm.gather_objects(
            {w: worker.state_dict(with_params=self.streaming) for w, worker in self.workers.items()}
        )
        if gathered is None:
            return None
        workers = {w: state for part in gathered for w, state in part.items()}
        pending = {f"{k}/{p}": {"due": due, "delta": future.wait()} for (k, p), (due, future) in self.pending.items()}
        return {
            "trainers": {k: t.state_dict() for k, t in self.trainers.items()},
            "workers": workers,
            "pending": pending,
        }

    def load_state_dict(self, state: dict) -> None:
        saved_trainers = state["trainers"]
        for k in list(self.trainers):
            if k not in saved_trainers:
                del self.trainers[k]
        for k, trainer_state in saved_trainers.items():
            self.trainers[k].load_state_dict(trainer_state)
            self.comm.register_group(self.trainers[k].worker_ids)
        for trainer in self.trainers.values():
            trainer.broadcast(self.workers)
        for w, worker in self.workers.items():
            worker.load_state_dict(state["workers"][w])  # streaming: its own parameters replace θ
        self.pending = {}
        for key, item in state.get("pending", {}).items():
            trainer_id, fragment = (int(x) for x in key.split("/"))
            future: Future = Future()
            future.set_result(list(item["delta"]))
            self.pending[(trainer_id, fragment)] = (int(item["due"]), future)
