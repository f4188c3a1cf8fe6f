"""PyTorch Lightning training made DiLoCo: ``Trainer(callbacks=[DiLoCoCallback(sync_every=10)])``.

Lightning's DDP strategy wraps the module in ``DistributedDataParallel``; the callback gives that wrapper a hook
that communicates nothing, so each rank is a DiLoCo worker. Lightning computes the gradients inside
``optimizer.step`` (its closure), so the callback calls ``DiLoCo.before_step`` from ``on_before_optimizer_step``
(after backward, before clipping and the step) and hooks only the step's end (a step a loss scaler skipped is
closed at the next one, so every rank counts alike). Works with ``lightning`` or ``pytorch_lightning``, whichever
is installed (``lightning`` first); one optimizer, automatic optimization.

Lightning writes rank 0's checkpoint only, while within a round every rank's model and optimizer are its own: the
callback gathers each rank's model, optimizer and DiLoCo state into the checkpoint (``adloco_diloco``, one entry
per rank), and a fit resumed from it (``ckpt_path``) gives every rank its own back.

As a fault-tolerant replica (``fault_tolerance=...``), each replica is a fit of its own on one device in a plain
process (not torchrun), reading its own data. A replica that starts while the others train heals from one of them
and takes their step: the callback moves Lightning's ``global_step`` and its per-step learning-rate schedules
forward to it, so ``max_steps`` and the schedule follow the job's step; and its data: Lightning's epoch becomes the
job's, and the fit reads on from the batch of it where a replica that never stopped reads at that step (in that
epoch's order where its sampler draws the order from the epoch, as ``DistributedSampler`` does).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from adloco.api import DiLoCo
from adloco.api.ddp import keep_gradients_local
from adloco.config.methods import method_named
from adloco.integrations.replicas import (
    SkippedBatches,
    advance_schedules,
    cannot_skip,
    check_replica_launch,
    data_position,
    is_replica,
    skip_batches,
    steps_behind,
    steps_per_epoch,
)

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl


class DiLoCoCallback(pl.Callback):
    """DiLoCo (or another ``method``: localsgd, streaming, ...) for the fit it is given to; the settings are
    ``adloco.DiLoCo``'s."""

    def __init__(self, sync_every: int | str = 10, method: str = "diloco", **settings: Any) -> None:
        if method_named(method).every_step:  # averaging gradients every step is Lightning's own DDP strategy
            raise ValueError(f"method={method!r} is Lightning's own DDP strategy; use it without adloco")
        self.settings = {"sync_every": sync_every, "method": method, **settings}
        self.diloco: DiLoCo | None = None
        self._resumed: dict[str, Any] | None = None  # this rank's state from the checkpoint a fit resumes from
        self._data_moved: _DataMoved | None = None  # a heal at the start moved the data, until a batch is trained

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"DiLoCo wraps one inner optimizer; configure_optimizers gave {len(trainer.optimizers)}")
        if trainer.global_step > 0 and self._resumed is None:
            raise ValueError(
                f"resuming at step {trainer.global_step} from a checkpoint without DiLoCo's state (written by a fit "
                "without DiLoCoCallback): every rank's own model, optimizer and DiLoCo state are needed"
            )
        check_replica_launch(self.settings, trainer.world_size, "Lightning Trainer")
        keep_gradients_local(trainer.strategy.model, trainer.world_size)
        optimizer, mine = trainer.optimizers[0], self._resumed
        replica = is_replica(self.settings)
        if mine is not None:  # Lightning restored rank 0's model and optimizer on every rank
            optimizer.load_state_dict(mine["optimizer"])
            if replica:  # its own state before its first quorum, where peers further on heal it
                pl_module.load_state_dict(mine["model"])
        start = mine["diloco"] if mine is not None and replica else None
        self.diloco = DiLoCo(pl_module, optimizer, state=start, **self.settings).hook(before=False)
        if mine is not None and not replica:
            pl_module.load_state_dict(mine["model"])  # DiLoCo's start gave every rank θ: each takes its own back
            self.diloco.load_state_dict(mine["diloco"])
        self._resumed, began = None, trainer.global_step
        _follow_heal(trainer, self.diloco)
        if trainer.global_step > began and mine is None:  # a fit resumed mid-epoch reads on as Lightning resumes it
            self._data_moved = _read_on_from(trainer, trainer.global_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._data_moved is not None:
            self._data_moved.land(trainer)
            self._data_moved = None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.diloco is None:
            return
        optimizer = trainer.optimizers[0]
        mine = {
            "model": pl_module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "diloco": self.diloco.state_dict(),
        }
        checkpoint[STATE_KEY] = _gather_on_first(_on_cpu(mine))

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(STATE_KEY)
        if states is None:
            return  # refused at the fit's start, where the step it resumes at is known
        if len(states) != trainer.world_size:
            raise ValueError(f"the checkpoint holds the DiLoCo state of {len(states)} ranks; this fit has "
                             f"{trainer.world_size}")  # fmt: skip
        self._resumed = states[trainer.global_rank]

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.diloco is not None:
            self.diloco.before_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        _follow_heal(trainer, self.diloco)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco.finish()  # the module is θ, for saving and evaluation


STATE_KEY = "adloco_diloco"


def _follow_heal(trainer: Any, diloco: DiLoCo | None) -> None:
    """A replica that healed from a peer goes on from the peers' step: Lightning's step counter (its optimizer
    steps, and the logger's step) and its per-step schedules too."""
    behind = steps_behind(diloco, trainer.global_step)
    if not behind:
        return
    epoch_loop = trainer.fit_loop.epoch_loop
    counted = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    counted.ready += behind
    counted.completed += behind
    epoch_loop._batches_that_stepped += behind
    advance_schedules(_schedules(trainer, "step"), behind)


def _schedules(trainer: Any, interval: str) -> list[Any]:
    """The learning-rate schedules Lightning steps once per ``interval`` (step or epoch)."""
    return [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == interval and c.frequency == 1]


def _read_on_from(trainer: Any, step: int) -> _DataMoved | None:
    """After a heal at the fit's start: Lightning's epoch is the job's at ``step``, and its data goes on from the
    batch where a replica that never stopped reads there (None where it cannot skip: it reads from the epoch's
    start)."""
    loader, accumulation = trainer.train_dataloader, trainer.accumulate_grad_batches
    batches = trainer.num_training_batches
    per_epoch = steps_per_epoch(batches, accumulation) if math.isfinite(batches) else step + 1
    epoch, into = data_position(step, per_epoch, accumulation)
    _enter_epoch(trainer, epoch)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)  # Lightning's pass, begun before this hook
    if not isinstance(loader, torch.utils.data.DataLoader) or fetcher is None:
        cannot_skip("Lightning fit", f"{type(loader).__name__}, not one DataLoader Lightning iterates")
        return None
    skipped = skip_batches(loader, into, "Lightning fit")
    if skipped is None:
        return None
    sampler = getattr(loader, "sampler", None)
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)
    loader._iterator = None  # persistent workers would keep the pass's iterator, and the old batch sampler in it
    iter(fetcher)  # its pass began with the batch sampler's old self: begin it again, skipping
    return _DataMoved(skipped, into, epoch * batches + into if math.isfinite(batches) else into)


def _enter_epoch(trainer: Any, epoch: int) -> None:
    """Lightning's epoch made ``epoch`` at the fit's start: its count, the schedules it steps per epoch, and the
    epoch it last reloaded its loader at (a loader reloaded now would lose the skip)."""
    progress = trainer.fit_loop.epoch_progress
    for counts in (progress.current, progress.total):
        counts.ready = counts.started = counts.processed = counts.completed = epoch
    advance_schedules(_schedules(trainer, "epoch"), epoch)
    if hasattr(trainer.fit_loop, "_last_train_dl_reload_epoch"):
        trainer.fit_loop._last_train_dl_reload_epoch = epoch


class _DataMoved:
    """Lightning's data after a heal at the fit's start, until its first batch is trained: a pass that skips
    ``into`` batches of the job's epoch (``before`` batches of the job so far). Lightning counts an epoch's batches
    from the first it fetched; at the first one trained, its counts take the skipped ones in, so the epoch's last
    batch, its short accumulation step and its validation come where they would for a replica that never stopped
    (the first batch's own ``batch_idx`` stays 0)."""

    def __init__(self, skipped: SkippedBatches, into: int, before: int) -> None:
        self.skipped, self.into, self.before = skipped, into, before

    def land(self, trainer: Any) -> None:
        self.skipped.batches = 0  # the skip is behind it: later epochs read from their start
        progress = trainer.fit_loop.epoch_loop.batch_progress
        for counts, skipped in ((progress.current, self.into), (progress.total, self.before)):
            counts.ready += skipped
            counts.started += skipped
            counts.processed += skipped
            counts.completed += skipped
        fetcher = trainer.fit_loop._data_fetcher
        fetcher.fetched += self.into
        if fetcher.length is not None:
            fetcher.done = fetcher.fetched >= fetcher.length
            progress.is_last_batch = fetcher.done


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU: what travels to rank 0 and into its checkpoint."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _gather_on_first(mine: Any) -> list[Any] | None:
    """Every rank's ``mine`` on rank 0, in rank order (None elsewhere): Lightning saves rank 0's checkpoint."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [mine]
    everyone: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return everyone
