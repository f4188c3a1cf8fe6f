"""DiLoCo, Streaming DiLoCo, LocalSGD and DDP around a user's own model, inner optimizer and training loop.

One worker per rank (under torchrun, or a process group the user made): the rank's model is the worker, its
optimizer the inner optimizer, and the rounds run through the very sync strategies ``adloco train`` uses
(``adloco.sync``), with the same exchange, codecs, outer optimizers and checkpoint state.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Sequence
from typing import Any

import torch

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.algorithms.flat import finite_rows
from adloco.algorithms.outer import OuterFactory
from adloco.api.adaptive import AdaptiveBatch
from adloco.batch.policy import TrainerBatch
from adloco.comm import Communicator, LocalCommunicator
from adloco.config import ConfigError, TrainConfig, build_config
from adloco.sync import RoundState, StepRecord, SyncStrategy, WorkerRound, build_strategy
from adloco.sync.rounds import SKIPPED_STEP
from adloco.trainer import Trainer

METHODS = ("diloco", "localsgd", "streaming", "ddp", "adloco")
_STATE_KEY = "adloco_diloco"


class LoopWorker:
    """The user's model as a sync strategy sees a worker: its trainable parameters, in θ's order."""

    def __init__(self, worker_id: int, params: Sequence[torch.Tensor]) -> None:
        self.worker_id = worker_id
        self.params = list(params)

    @torch.no_grad()
    def load_params(self, theta: Sequence[torch.Tensor]) -> None:
        for p, t in zip(self.params, theta, strict=True):
            p.copy_(t)

    def gradients(self) -> list[torch.Tensor]:
        """The gradients, zeros where a parameter took part in no backward (a DDP mean needs every tensor)."""
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]

    @torch.no_grad()
    def set_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(p.device, dtype=p.dtype, copy=True)


def loop_settings(method: str, sync_every: int, world_size: int, sections: dict[str, Any]) -> TrainConfig:
    """The settings of a user's loop, validated exactly as ``adloco train`` validates its config (the same keys,
    defaults per method and one-line errors)."""
    if method not in METHODS:
        raise ConfigError(f"method: {method!r} is not one of {', '.join(METHODS)}")
    given = {name: dict(value) for name, value in sections.items() if value is not None}
    return build_config({"method": method, "sync_every": sync_every, "workers": world_size, **given})


class DiLoCo:
    """DiLoCo (or ``method`` = localsgd, streaming, ddp) around ``model`` and its inner ``optimizer``.

    Use it as a context manager around an unchanged loop (it hooks ``optimizer.step``), or call ``step()`` after
    each ``optimizer.step()``. Every ``sync_every`` inner steps the workers (one per rank of ``process_group``,
    default: the whole job) exchange their drift and the outer optimizer steps θ. Settings are the config's
    sections: ``outer`` (lr, momentum, nesterov, overlap), ``streaming`` (fragments, overlap τ, alpha,
    assignment, shared) and ``codec`` (name, block_size, error_feedback); ``outer_optimizer`` replaces the outer
    SGD with any torch optimizer made from θ's tensors. Its state (θ, outer state, exchanges in flight, error
    feedback) comes and goes with ``state_dict``/``load_state_dict``, also as a ``torch.distributed.checkpoint``
    ``Stateful``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int = 10,
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
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        _check_optimizer(optimizer, self.params)
        if outer_optimizer is not None and method in ("localsgd", "ddp"):
            raise ValueError(f"method={method!r} has no outer optimizer of its own to replace; use method='diloco'")
        self.comm = _communicator(process_group, self.params[0].device)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        sections = {"outer": outer, "streaming": streaming, "codec": codec, "batch": batch}
        self.config = loop_settings(method, sync_every, self.world_size, sections)
        assert self.config.sync_every is not None
        self.sync_every = self.config.sync_every
        self.check_finite = check_finite  # off where a loss scaler already keeps overflowing steps out
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.comm.set_placement({w: w for w in range(self.world_size)})
        _check_same_job(self.comm, self.rank, self.params, self._fingerprint())
        self.trainer = _trainer(self.config, self.params, names, self.world_size, outer_optimizer)
        self.comm.broadcast_tensors(self.trainer.theta, src=0)  # every rank starts from rank 0's parameters
        self.workers = {self.rank: LoopWorker(self.rank, self.params)}
        self.trainer.broadcast(self.workers)
        self.sync: SyncStrategy = build_strategy(
            self.config, self.comm, {0: self.trainer}, self.workers, outer_optimizer
        )
        self.batch: AdaptiveBatch | None = None  # AdLoCo's adaptive batch (method adloco, or a batch section given)
        if self.config.method == "adloco" or batch is not None:
            self.batch = AdaptiveBatch(self.config.batch, optimizer, self.params, self.world_size, self.sync_every,
                                       total_samples)  # fmt: skip
        self.inner_step = 0  # inner steps taken since the start, over every round
        self._state = self._new_round()
        self._hooks: list[Any] = []
        self.last_round: RoundState | None = None  # the round that ended last, with every worker's report
        self._finished = False

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
        healthy = not self.check_finite or _finite([p.grad for p in self.params if p.grad is not None])
        self._record(finite=record.out or healthy)
        stepping = self.sync.after_backward(self._state, self.round_step)
        if self.rank not in stepping:
            for p in self.params:
                p.grad = None  # a torch optimizer leaves a parameter without a gradient alone
        if self.batch is not None:
            self.batch.scale_lr()

    def _check_running(self) -> None:
        if self._finished:
            raise RuntimeError("DiLoCo.finish() ended this training: make a new DiLoCo to train on")

    @property
    def round_step(self) -> int:
        """Inner steps taken in the round in progress."""
        return self.inner_step - self._state.first_step

    def _new_round(self) -> RoundState:
        state = RoundState(self.inner_step // self.sync_every, self.sync_every, self.inner_step, False)
        state.local = {self.rank: WorkerRound()}
        if self.batch is not None:
            self.batch.start_round(state.index)
            state.statistics_due = self.batch.statistics_due
        return state

    def _record(self, finite: bool) -> None:
        record = self._state.local[self.rank]
        record.steps.append(SKIPPED_STEP if record.out else StepRecord(loss=math.nan, tokens=0, finite=finite))

    def _after_step(self) -> None:
        self._check_running()
        if len(self._state.local[self.rank].steps) == self.round_step:  # no before_step: nothing to check then
            if self.config.method == "ddp":
                raise RuntimeError("method='ddp' averages gradients before the optimizer step: use `with diloco:`")
            if self.batch is not None and self.batch.lr_scale != 1.0:
                raise RuntimeError("the batch's lr factor applies before the optimizer step: use `with diloco:`")
            self._record(finite=True)
        if self.batch is not None:
            self.batch.after_step(self._state.local[self.rank])
        self.sync.after_inner_step(self._state, self.round_step)
        self.inner_step += 1
        if self.round_step >= self.sync_every:
            self._end_round()

    def _end_round(self) -> None:
        state = self._state
        record = state.local[self.rank]
        if not record.out and not _finite(self.params):  # a step outside the hooks may have diverged
            record.out = True
        steps = self.round_step
        if self.batch is not None:
            self.batch.stamp(state, self.rank, steps)
        self.sync.end_of_round(state)
        if self.batch is not None:
            self.batch.after_round(state, steps)
        if record.out:
            self.optimizer.state.clear()  # it restarts from θ (the strategy saw to that); its moments may hold NaN
        self.last_round = state
        self._state = self._new_round()

    def flush(self) -> None:
        """Apply the exchanges still in flight (streaming, overlap) to θ and the model: at the end of training."""
        self.sync.flush()

    def finish(self, into_model: bool = True) -> None:
        """End of training (every rank, after the same number of steps): a round in progress ends here as a shorter
        one, the exchanges in flight are applied, and (``into_model``) the model is set to θ, the model DiLoCo
        trained. The exchange's process group is let go of here: nothing of this object holds it afterwards."""
        if self._finished:
            return
        if len(self._state.local[self.rank].steps) > self.round_step:  # a last step a loss scaler skipped
            self._after_step()
        if self.round_step > 0:
            self._end_round()
        self.flush()
        if into_model:
            self.workers[self.rank].load_params(self.trainer.theta)
        # The exchanges' callbacks ran on gloo's threads; a group handle released last by one of them would be
        # destroyed there, and its destructor joining its own thread aborts the process.
        self.comm.close()
        self._finished = True

    def _fingerprint(self) -> list[float]:
        """What every rank must agree on: the method, H, fragments, codec, each rank's model shapes and dtypes."""
        config = self.config
        batch = (config.batch.size, config.batch.test, config.batch.controller, config.batch.b_max)
        settings = (config.method, self.sync_every, config.streaming.fragments, config.codec.name, batch)
        model = tuple((tuple(p.shape), str(p.dtype)) for p in self.params)
        return [float(len(self.params)), float(sum(p.numel() for p in self.params)), _digest(settings), _digest(model)]

    @property
    def theta(self) -> list[torch.Tensor]:
        """The global parameters θ (the model itself drifts from them within a round)."""
        return self.trainer.theta

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """θ, the outer optimizer state, exchanges in flight, this rank's error feedback (and eager copy) and the
        round in progress, as one value per rank (a DCP ``Stateful`` keeps each rank's apart)."""
        state = {
            "inner_step": self.inner_step,
            "world_size": self.world_size,
            "settings": self._settings(),
            "trainer": self.trainer.state_dict(),
            "pending": self.sync.state_dict(),
            "worker": self.sync.worker_state(self.rank),
            "round": self._state.local[self.rank].to_tensor(),
            "batch": None if self.batch is None else self.batch.state_dict(),
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {f"{_STATE_KEY}_rank{self.rank}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"{_STATE_KEY}_rank{self.rank}"
        if key not in state_dict:
            raise ValueError(f"this state holds no DiLoCo state of rank {self.rank} (keys: {sorted(state_dict)[:4]})")
        state = torch.load(io.BytesIO(state_dict[key]), weights_only=True)
        if state["world_size"] != self.world_size:
            raise ValueError(f"the state was saved by {state['world_size']} ranks; this job has {self.world_size}")
        if state.get("settings", self._settings()) != self._settings():
            raise ValueError(f"the state was saved with other settings ({state['settings']}); now {self._settings()}")
        self.trainer.load_state_dict(state["trainer"])
        self.sync.load_state_dict(state["pending"])
        drifted = [p.detach().clone() for p in self.params]  # the model's own state is the user's to load
        self.sync.load_worker_state(self.rank, state["worker"])
        self.workers[self.rank].load_params(drifted)
        self.inner_step = int(state["inner_step"])
        in_progress = WorkerRound.from_tensor(state["round"])
        self._state = self._new_round()
        self._state.first_step = self.inner_step - len(in_progress.steps)
        self._state.local[self.rank] = in_progress
        if self.batch is not None:
            self.batch.load_state_dict(state["batch"])  # the round's plan and β2 follow the batch it holds
            self.batch.first_step = self.round_step == 0

    def _settings(self) -> dict[str, Any]:
        """What a saved state only fits: the method, H and the exchange's shape."""
        config = self.config
        return {
            "method": config.method,
            "sync_every": self.sync_every,
            "fragments": config.streaming.fragments,
            "overlap": config.outer.overlap,
            "codec": config.codec.name,
            "error_feedback": config.codec.error_feedback,
            **(
                {} if self.batch is None else {"batch": (config.batch.size, config.batch.test, config.batch.controller)}
            ),
        }


def _digest(value: Any) -> float:
    """A number that tells values apart alike in every process (unlike ``hash`` of text)."""
    return float(int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "big"))


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    rows = [t.reshape(1, -1) for t in tensors if t.numel() > 0]
    return bool(finite_rows(rows).all()) if rows else True


def _check_optimizer(optimizer: Any, params: list[torch.Tensor]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DiLoCo needs a torch.optim.Optimizer (the inner optimizer), got {type(optimizer).__name__}")
    if not params:
        raise ValueError("the model has no trainable parameters")
    mine = {id(p) for p in params}
    foreign = sum(id(p) not in mine for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ValueError(f"the optimizer updates {foreign} tensor(s) that are not the model's trainable parameters")


def _communicator(process_group: Any, device: torch.device) -> Communicator:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        return LocalCommunicator()
    from adloco.comm.distributed import DistributedCommunicator

    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError("this rank is not a member of the process_group given to DiLoCo")
    return DistributedCommunicator.on_group(process_group, device=device)


def _check_same_job(comm: Communicator, rank: int, params: list[torch.Tensor], fingerprint: list[float]) -> None:
    """Every rank must hold a model of the same shapes and the same settings: refuse on every rank (rather than
    hang in a collective only some reach, or average unlike tensors)."""
    seen = comm.gather_worker_scalars({rank: fingerprint})
    if any(v != seen[0] for v in seen.values()):
        raise ValueError(
            "the ranks hold different models or DiLoCo settings (method, sync_every, fragments, codec): every rank "
            "must build the same model and DiLoCo"
        )


def _trainer(
    config: TrainConfig, params: list[torch.Tensor], names: list[str], workers: int, factory: OuterFactory | None
) -> Trainer:
    from adloco.cluster import parameter_fragments

    outer = config.outer
    assert outer.lr is not None and outer.momentum is not None
    return Trainer(
        0,
        [p.detach() for p in params],
        list(range(workers)),
        TrainerBatch(1, BatchSizeController("constant", b_cap=1)),  # the loop's own batch; a constant one
        outer_lr=outer.lr,
        outer_momentum=outer.momentum,
        nesterov=bool(outer.nesterov),
        fragments=parameter_fragments(config, names),
        outer_factory=factory,
    )
