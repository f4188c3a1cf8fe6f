"""DiLoCo, Streaming DiLoCo, LocalSGD and DDP around a user's own model, inner optimizer and training loop.

One worker per rank (under torchrun, or a process group the user made): the rank's model is the worker, its
optimizer the inner optimizer, and the rounds run through the very sync strategies ``adloco train`` uses
(``adloco.sync``), with the same exchange, codecs, outer optimizers and checkpoint state.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.algorithms.flat import bits_digest
from adloco.algorithms.outer import OuterFactory
from adloco.algorithms.sharding import local_rows
from adloco.api.adaptive import NO_BATCH, AdaptiveBatch, NoAdaptiveBatch
from adloco.api.checks import (
    StepCount,
    check_layout,
    check_optimizer,
    check_same_job,
    distributed_world_size,
    job_fingerprint,
    warn_unfinished,
)
from adloco.api.ddp import local_model
from adloco.api.finish_line import FinishLine, WatchedCommunicator
from adloco.api.loop_state import LoopState
from adloco.api.replica import Replica
from adloco.api.rounds import LoopRounds, first_group_lr
from adloco.api.settings import LoopSettings, loop_settings
from adloco.api.worker import LoopWorker, WorkerShards, finite, gradient_divisor, worker_shards
from adloco.batch.policy import TrainerBatch
from adloco.cluster.batches import auto_sync_every
from adloco.cluster.placement import placement
from adloco.cluster.round_end import RoundEnd
from adloco.cluster.trainers import MergeEvent, maybe_merge
from adloco.comm.base import Communicator
from adloco.comm.launcher import world_size_from_env
from adloco.comm.local import LocalCommunicator
from adloco.config.methods import METHODS, method_named
from adloco.sync import (
    RoundState,
    StepRecord,
    SyncSettings,
    SyncStrategy,
    WorkerRound,
    build_strategy,
    outer_factory,
)
from adloco.sync.streaming import parameter_fragments
from adloco.sync.trainer import Trainer, theta_device
from adloco.workers.reports import SKIPPED_STEP


class DiLoCo(LoopState):
    """DiLoCo (or another registered ``method``: localsgd, streaming, ddp, adloco, ...; ``adloco.config.methods``)
    around ``model`` and its inner ``optimizer``.

    Use it as a context manager around an unchanged loop (it hooks ``optimizer.step``), or call ``step()`` after
    each ``optimizer.step()``. Every ``sync_every`` inner steps the workers (one per rank of ``process_group``,
    default: the whole job; a process group or a 1-D ``DeviceMesh``) exchange their drift and the outer optimizer
    steps θ. A model sharded with FSDP2 over other ranks makes each worker span them: every rank exchanges its own
    rows with the ranks that hold the same rows of the other workers (``process_group=mesh["replicate"]``).
    Settings are the config's sections: ``outer`` (lr, momentum, nesterov, overlap), ``streaming`` (fragments,
    overlap τ, alpha, assignment, shared) and ``codec`` (name, block_size, error_feedback); ``outer_optimizer``
    replaces the outer SGD with any torch optimizer made from θ's tensors; ``trainers`` splits the job into that
    many trainers, merged as ``merge`` (the config's section) says. ``sync_every="auto"`` chooses H at each
    round's end from the loop's measured step and exchange times and the workers' dispersion (bounds and scale
    in ``sync_auto``; ``rounds.length`` is the H of the round in progress, ``rounds.last`` the last decision).
    Its state (θ, outer state, exchanges in flight, error feedback) comes and goes with
    ``state_dict``/``load_state_dict``, also as a ``torch.distributed.checkpoint`` ``Stateful``; ``state`` loads
    one at the start, before a fault-tolerant replica's first quorum (so it heals only from peers further on).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int | str = 10,
        method: str = "diloco",
        *,
        outer: dict[str, Any] | None = None,
        streaming: dict[str, Any] | None = None,
        codec: dict[str, Any] | None = None,
        outer_optimizer: OuterFactory | None = None,
        process_group: Any = None,
        check_finite: bool = True,
        batch: dict[str, Any] | None = None,
        total_samples: int | None = None,
        trainers: int = 1,
        merge: dict[str, Any] | None = None,
        sync_auto: dict[str, Any] | None = None,
        fault_tolerance: dict[str, Any] | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        model = local_model(model, distributed_world_size(fault_tolerance))
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        check_optimizer(optimizer, self.params)
        if outer_optimizer is not None and method_named(method).outer_fixed:
            raise ValueError(f"method={method!r} has no outer optimizer of its own to replace; use method='diloco'")
        if outer_optimizer is not None and (outer or {}).get("optimizer", "sgd") != "sgd":
            raise ValueError("give either outer_optimizer= or outer={'optimizer': ...}, not both")
        self.shards: WorkerShards | None = worker_shards(self.params)  # a worker spanning several ranks (FSDP2)
        sections = {"outer": outer, "streaming": streaming, "codec": codec, "batch": batch, "merge": merge,
                    "sync_auto": sync_auto, "fault_tolerance": fault_tolerance}  # fmt: skip
        adaptive = method_named(method).adaptive_batch or batch is not None
        check_layout(trainers, self.shards, process_group)  # before anything connects
        self._connect(method, sync_every, sections, trainers, process_group)
        # their count and H (sync_every="auto": chosen at each round's end)
        settings = self.settings
        auto = auto_sync_every(settings.sync_every, settings.sync_auto, settings.streaming, settings.workers)
        self.rounds = LoopRounds(settings.first_sync_every, auto, first_group_lr(optimizer), self.shards)
        self.check_finite = check_finite  # off where a loss scaler already keeps overflowing steps out
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.comm.set_placement({w: w for w in range(self.world_size)})
        self.workers = {self.rank: LoopWorker(self.rank, self.params)}
        if self.replica is None:  # replicas compare their settings when one heals from another
            fingerprint = job_fingerprint(self.settings, self.workers[self.rank].params, self.shards, check_finite)
            check_same_job(self.comm, self.rank, fingerprint)
        self._start_trainers(names, outer_optimizer, adaptive)
        self.merges: list[MergeEvent] = []  # the merges of several trainers, as they happened
        self._batch: AdaptiveBatch | None = None  # AdLoCo's adaptive batch (method adloco, or a batch section given)
        if adaptive:
            divisor = 1.0 if self.shards is None else gradient_divisor(model, self.shards)
            self._batch = AdaptiveBatch(self.settings.batch, optimizer, self.params, self.trainers, self.rank,
                                       self.rounds, total_samples, self.shards, divisor)  # fmt: skip
        shard_sum = None if self.shards is None else partial(_summed_over_shards, self.shards)
        restart = partial(_restart_if_out, optimizer, self.rank)  # nothing in it refers back to this object
        self._round_end = RoundEnd(self.sync, self.comm, self.trainers, restart, shard_sum)
        self.inner_step = 0  # inner steps taken since the start, over every round
        self._state = self._new_round()
        self._hooks: list[Any] = []
        # every optimizer step, counted apart from DiLoCo's own (an integer, no reference back to DiLoCo): a step
        # DiLoCo did not see (before `with diloco:`, after it) is warned about once
        self._optimizer_steps = StepCount()
        self._counting = optimizer.register_step_post_hook(self._optimizer_steps.add)
        self._steps_seen = 0  # optimizer steps up to DiLoCo's last inner step
        self._warned_outside = False
        self.last_round: RoundState | None = None  # the round that ended last, with every worker's report
        self._finished = self._finishing = False
        self._warned_unmeasured = False
        # a loop that trained and never called finish() leaves each rank its own drifted model: said at exit (or when
        # the object is collected); finish() detaches it
        self._unfinished = weakref.finalize(self, warn_unfinished, self.rounds, self._line)
        if state is not None:  # before a replica's first quorum, which heals it from peers that are further on
            self.load_state_dict(state)
        if self.replica is not None:
            self._join_round()

    def _connect(
        self, method: str, sync_every: int | str, sections: dict[str, Any], trainers: int, process_group: Any
    ) -> None:
        """The settings and the exchange's transport: the process group's ranks, or this process as a
        fault-tolerant replica (torchft) when ``fault_tolerance`` is given."""
        device = local_rows(self.params[0]).device
        self.replica: Replica | None = None
        if sections["fault_tolerance"] is not None:
            self.settings = _replica_settings(method, sync_every, sections, trainers, process_group, self.shards)
            self.replica = Replica(self.settings.fault_tolerance, self._shared_state, self._heal,
                                   lambda: self.rounds.count, device, self.shards)  # fmt: skip
            self.replica.comm.theta_digest = self._theta_digest  # a split job shows in it
            self.replica.comm.keeps_slots = trainers > 1  # the other trainers read the own exchanges' slots
            self.comm: Communicator = self.replica.comm
            self._line: FinishLine | None = None
        else:
            self.comm, self._line = _communicator(process_group, device)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.global_rank = self.rank if self.replica is not None else _global_rank()
        if self.replica is None:
            self.settings = loop_settings(method, sync_every, self.world_size, sections, trainers)

    def _theta_digest(self) -> int:
        """Every trainer's θ as one number, the same on every replica of a healthy job (each holds them all)."""
        return bits_digest([tensor for trainer in self.trainers.values() for tensor in trainer.theta])

    def _start_trainers(self, names: list[str], outer_optimizer: OuterFactory | None, adaptive: bool) -> None:
        """The job's trainers, each from its first worker's parameters and with its exchange group, and the sync
        strategy over them; this rank's worker starts from its trainer's θ."""
        self.trainers = _trainers(self.settings, self.workers[self.rank].params, names, outer_optimizer, adaptive)
        for trainer in self.trainers.values():
            self.comm.broadcast_tensors(trainer.theta, src=trainer.worker_ids[0])
            self.comm.register_group(trainer.worker_ids)
        self.trainer.broadcast(self.workers)
        self.sync: SyncStrategy = build_strategy(
            SyncSettings.of(self.settings), self.comm, self.trainers, self.workers, outer_optimizer
        )

    # -- the loop ------------------------------------------------------------------------------------------------
    def __enter__(self) -> DiLoCo:
        return self.hook()

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def hook(self, before: bool = True) -> DiLoCo:
        """Hook the optimizer: ``before_step`` before each of its steps (``before=False``: the caller calls it, as a
        framework whose optimizer step computes the gradients inside it must), ``step`` after each."""
        if self._hooks:
            raise RuntimeError("DiLoCo already hooks the optimizer")
        if before:
            self._hooks.append(self.optimizer.register_step_pre_hook(lambda *_: self.before_step()))
        self._hooks.append(self.optimizer.register_step_post_hook(lambda *_: self._after_step()))
        return self

    def step(self) -> None:
        """After each ``optimizer.step()`` when the optimizer is not hooked (DDP needs ``before_step`` too: it
        averages the gradients before the optimizer step)."""
        if self._hooks:
            raise RuntimeError("DiLoCo.step() is called by the optimizer's hook inside `with diloco:`; not twice")
        self._after_step()

    def before_step(self) -> None:
        """Between backward and the optimizer step: the strategy's exchange there (DDP's gradient mean) and the
        health of this step's gradients; a worker out of its round takes no optimizer step."""
        self._check_running()
        record = self._state.local[self.rank]
        if len(record.steps) > self.round_step:  # the last step never reached its end: a loss scaler skipped it
            self._after_step()
            record = self._state.local[self.rank]
        healthy = not self.check_finite or self._all_finite([p.grad for p in self.params if p.grad is not None])
        self._record(finite=record.out or healthy)
        stepping = self.sync.after_backward(self._state, self.round_step)
        if self.rank not in stepping:
            for p in self.params:
                p.grad = None  # a torch optimizer leaves a parameter without a gradient alone
        if self._batch is not None:
            self._batch.scale_lr()

    def _check_running(self) -> None:
        if self._line is not None and self._line.refusal is not None:
            raise RuntimeError(self._line.refusal)
        if self._finished:
            raise RuntimeError("DiLoCo.finish() ended this training: make a new DiLoCo to train on")

    @property
    def round_step(self) -> int:
        """Inner steps taken in the round in progress."""
        return self.inner_step - self._state.first_step

    def _new_round(self) -> RoundState:
        h = self.rounds.length
        state = RoundState(self.rounds.count, h, self.inner_step, False, h)
        state.local = {self.rank: WorkerRound()}
        self.rounds.start()
        if self._batch is not None:
            self._batch.start_round(state.index)
            state.statistics_due = self._batch.statistics_due
        return state

    def _record(self, finite: bool) -> None:
        record = self._state.local[self.rank]
        record.steps.append(SKIPPED_STEP if record.out else StepRecord(loss=math.nan, tokens=0, finite=finite))
        if self._line is not None:  # the count a rank ahead names, should it wait in an exchange no peer reaches
            self._line.steps = self._state.first_step + len(record.steps)

    def _after_step(self) -> None:
        self._check_running()
        if len(self._state.local[self.rank].steps) == self.round_step:  # no before_step: nothing to check then
            if METHODS[self.settings.method].every_step:
                raise RuntimeError(
                    f"method={self.settings.method!r} averages gradients before the optimizer step: use `with diloco:`"
                )
            if self._batch is not None and self._batch.lr_scale != 1.0:
                raise RuntimeError("the batch's lr factor applies before the optimizer step: use `with diloco:`")
            self._record(finite=True)
        if self._optimizer_steps.count - self._steps_seen > 1:
            self._outside(self._optimizer_steps.count - self._steps_seen - 1, "before this inner step")
        self._steps_seen = self._optimizer_steps.count
        if self._batch is not None:
            self._batch.after_step(self._state.local[self.rank])
        self.sync.after_inner_step(self._state, self.round_step)
        self.inner_step += 1
        if self.round_step >= self.rounds.length:
            self._end_round()

    def _end_round(self) -> None:
        state = self._state
        record = state.local[self.rank]
        healthy = self._all_finite(self.params)
        if not record.out and not healthy:  # a step outside the hooks may have diverged
            record.out = True
        steps = self.round_step
        if self._batch is not None:
            if state.statistics_due and steps and record.statistics is None and not record.out:
                self._unmeasured()
            self._batch.stamp(state, self.rank, steps)
        self.rounds.stamp(record, steps, self._round_end.exchange_seconds)
        self._round_end(state, self._batch, self.rounds)
        self._merge_if_due(state)  # after H is chosen, as adloco train's merges
        self.last_round = state
        self._state = self._new_round()
        if self.replica is not None:
            if self._batch is not None and self.replica.history:  # b as decided, as adloco train's round records
                self.replica.history[-1].batch = {k: trainer.batch.size for k, trainer in self.trainers.items()}
            self.replica.end_round(None if self.rounds.last is None else self.rounds.last.to_dict())
            if not self._finishing:
                self._join_round()

    def _outside(self, steps: int, when: str) -> None:
        """Warn once: optimizer steps DiLoCo did not see (outside `with diloco:`, without diloco.step())."""
        if not self._warned_outside:
            self._warned_outside = True
            warnings.warn(
                f"{steps} optimizer step(s) ran {when} outside DiLoCo (before `with diloco:` or after it, or without "
                "diloco.step()): they count in no round, and only move this rank's model, into the next exchange's "
                "drift (docs/own-loop.md)",
                stacklevel=3,
            )

    def _unmeasured(self) -> None:
        """Warn once: a round due to measure the batch's statistics measured none, so b cannot move."""
        if not self._warned_unmeasured:
            self._warned_unmeasured = True
            warnings.warn(
                "method='adloco': the round's first step measured no batch statistics (the loop ran its own "
                "backward, not diloco.batch.backward(loss_fn, *batch)), so b cannot move",
                stacklevel=4,
            )

    def _join_round(self) -> None:
        """The next round's quorum (a heal there replaces this replica's state), and the round's H in its record."""
        assert self.replica is not None
        self.replica.start_round()
        self.replica.history[-1].sync_every = self.rounds.length

    def _merge_if_due(self, state: RoundState) -> None:
        """AdLoCo's merge of several trainers when one is due (``merge.every`` rounds)."""
        if len(self.trainers) > 1:
            event = maybe_merge(self.comm, self.trainers, self.workers, self.settings.merge, state.index)
            if event is not None:
                self.merges.append(event)

    @property
    def batch(self) -> AdaptiveBatch | NoAdaptiveBatch:
        """AdLoCo's adaptive batch (``method="adloco"``, or a ``batch`` section given); without it a false value
        whose every use is one clear error."""
        return NO_BATCH if self._batch is None else self._batch

    @property
    def config(self) -> LoopSettings:
        """The earlier name of ``settings`` (a whole root config then), kept for one release."""
        warnings.warn("DiLoCo.config is now DiLoCo.settings (the old name works until the next release)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return self.settings

    @property
    def trainer(self) -> Trainer:
        """The trainer this rank's worker belongs to (with several trainers, another one after a merge)."""
        return next(t for t in self.trainers.values() if self.rank in t.worker_ids)

    def flush(self) -> None:
        """Apply the exchanges still in flight (streaming, overlap) to θ and the model: at the end of training."""
        self.sync.flush()

    def finish(self, into_model: bool = True) -> None:
        """End of training (every rank, after the same number of steps): a round in progress ends here as a shorter
        one, the exchanges in flight are applied, and (``into_model``) the model is set to θ, the model DiLoCo
        trained. The exchange's process group is let go of here: nothing of this object holds it afterwards."""
        if self._finished:
            return
        self._check_running()  # a rank that refused inside an exchange refuses here again
        if len(self._state.local[self.rank].steps) > self.round_step:  # a last step a loss scaler skipped
            self._after_step()
        if self._optimizer_steps.count > self._steps_seen:
            self._outside(self._optimizer_steps.count - self._steps_seen, "after the last inner step")
        self._counting.remove()
        if self._line is not None:  # refuses (and lets go of the group) on every rank if the counts differ
            assert isinstance(self.comm, WatchedCommunicator)
            self._line.arrive(self.comm, self.inner_step)
            self.comm.line = None  # every rank is here, at as many steps: finish()'s exchanges need no watching
        if self.inner_step == 0:  # θ is the untrained start: setting the model to it would undo the loop's work
            raise RuntimeError(
                "no round ran: enter `with diloco:` or call `diloco.step()` after each optimizer.step(); finish() "
                "would set the model to the untrained θ"
            )
        self._finishing = True
        if self.round_step > 0:
            self._end_round()
        elif self.replica is not None and self.replica.history:
            self.replica.history.pop()  # the quorum of a round that never came: the loop ended at a boundary
        self.flush()
        if into_model:
            self.workers[self.rank].load_params(self.trainer.theta)
        # The exchanges' callbacks ran on gloo's threads; a group handle released last by one of them would be
        # destroyed there, and its destructor joining its own thread aborts the process.
        self.comm.close()
        self._finished = True
        self._unfinished.detach()

    def _all_finite(self, tensors: Sequence[torch.Tensor]) -> bool:
        """No NaN or inf in ``tensors``, over every shard of this rank's worker."""
        healthy = finite(tensors)
        return healthy if self.shards is None else self.shards.all_agree(healthy)

    @property
    def theta(self) -> list[torch.Tensor]:
        """The global parameters θ (the model itself drifts from them within a round)."""
        return self.trainer.theta


def _summed_over_shards(shards: WorkerShards, worker_sq: list[float], mean_sq: float) -> tuple[list[float], float]:
    total = shards.sum([*worker_sq, mean_sq])
    return total[:-1], total[-1]


def _restart_if_out(optimizer: torch.optim.Optimizer, rank: int, state: RoundState) -> None:
    """A worker out of the round restarts from θ (the strategy saw to that) with fresh optimizer moments: its
    own may hold NaN."""
    if state.local[rank].out:
        optimizer.state.clear()


def _communicator(process_group: Any, device: torch.device) -> tuple[Communicator, FinishLine | None]:
    """The exchange's transport over ``process_group``, and the finish line where its ranks compare their step
    counts (none in one process)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        ranks = world_size_from_env()
        if ranks > 1:  # each rank would train alone, a one-worker DiLoCo of its own, without a word
            raise RuntimeError(
                f"the launcher started {ranks} ranks (WORLD_SIZE) but torch.distributed is not initialised: call "
                "dist.init_process_group() before DiLoCo(...), or run one process without torchrun"
            )
        return LocalCommunicator(), None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"DiLoCo exchanges over one mesh dimension, not a {process_group.ndim}-D mesh: give it "
                "mesh['replicate'] (the dimension across workers)"
            )
        process_group = process_group.get_group()
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError("this rank is not a member of the process_group given to DiLoCo")
    # Two workers' Δ summed either way round are the same bits (a + b = b + a in floating point, signed zeros
    # too), so an exchange between two ranks all-reduces instead of all-gathering: the numbers are adloco train's,
    # and on loopback gloo all-reduces a 3.3 M-parameter Δ in 12 ms against 27 for the all-gather, with fewer
    # copies around it. With three or more the backend's order of additions is not worker order: those gather.
    # NCCL keeps the gather (the pair's bits are untested there).
    pair = dist.get_world_size(process_group) == 2 and dist.get_backend(process_group) == "gloo"
    comm = WatchedCommunicator.on_group(process_group, reduce="allreduce" if pair else "gather", device=device)
    if comm.world_size > 1:
        comm.line = FinishLine(process_group, comm.rank, comm.world_size)
    return comm, comm.line


def _replica_settings(
    method: str,
    sync_every: int | str,
    sections: dict[str, Any],
    trainers: int,
    process_group: Any,
    shards: WorkerShards | None,
) -> LoopSettings:
    """The settings of a fault-tolerant replica: one worker per replica (a process, or the ranks of a sharded one),
    the job's size from the section."""
    if process_group is not None:
        raise ValueError("a fault-tolerant replica is one worker: no process_group (the replicas exchange over "
                         "torchft's); a sharded worker's replica is its shard group's ranks")  # fmt: skip
    replicas = sections["fault_tolerance"].get("replicas")
    world = replicas if isinstance(replicas, int) and replicas > 0 else 1
    return loop_settings(method, sync_every, world, sections, trainers)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _trainers(
    settings: LoopSettings,
    params: list[torch.Tensor],
    names: list[str],
    factory: OuterFactory | None,
    adaptive: bool,
) -> dict[int, Trainer]:
    """The job's trainers, each over its workers (trainer k: ranks k·M … k·M + M − 1), θ from ``params`` for now;
    with the adaptive batch each holds its own ``TrainerBatch``, else a constant one (the loop's own batch)."""
    outer = settings.outer
    assert outer.lr is not None and outer.momentum is not None
    home = theta_device(outer.device, params[0].device, sum(p.numel() for p in params), user_loop=True)
    return {
        k: Trainer(
            k,
            [p.detach().to(home) for p in params],  # this rank's rows of them when the model is sharded
            worker_ids,
            TrainerBatch.from_config(settings.batch)
            if adaptive
            else TrainerBatch(1, BatchSizeController("constant", b_cap=1)),
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            nesterov=bool(outer.nesterov),
            fragments=parameter_fragments(settings.streaming, names),
            outer_factory=factory or outer_factory(outer),
        )
        for k, worker_ids in placement(settings.trainers, settings.workers).items()
    }
