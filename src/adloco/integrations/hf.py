"""A Hugging Face ``transformers.Trainer`` run made DiLoCo: ``use_diloco(trainer, sync_every=10)``.

Under torchrun the Trainer wraps the model in ``DistributedDataParallel``, which averages the gradients of every
backward; DiLoCo's workers must drift apart instead. The callback gives that DDP a communication hook that
communicates nothing (the model stays wrapped, so the Trainer's own code paths stay as they are), follows the
Trainer's optimizer steps, and hands θ back to the model when training ends, so ``trainer.save_model`` saves the
model DiLoCo trained. Each optimizer step is one inner step (after gradient accumulation). The Trainer's
``average_tokens_across_devices`` (on by default) would gather a token count across ranks every step: ``use_diloco``
turns it off.

As a fault-tolerant replica (``fault_tolerance=...``), each replica is a Trainer of its own in a plain process (not
torchrun), reading its own dataset. A replica that starts while the others train heals from one of them and takes
their step: the callback moves the Trainer's ``global_step`` and learning-rate schedule forward to it, so
``max_steps``, the schedule and the save steps follow the job's step; and its data: it reads on from the epoch and
batch where a replica that never stopped reads at that step (in that epoch's order, which the Trainer's sampler
draws from its seed and the epoch). One resumed from the Trainer's checkpoint starts from its own state there and
heals only from peers further on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import has_length

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
    shift_sampler_epochs,
    skip_batches,
    steps_behind,
    steps_per_epoch,
)

STATE_FILE = "adloco_diloco_rank{rank}.pt"  # in each of the Trainer's checkpoint folders, one per rank


class DiLoCoCallback(TrainerCallback):
    """DiLoCo (or another ``method``: localsgd, streaming, ...) for ``trainer``'s run; the settings are
    ``adloco.DiLoCo``'s.

    The Trainer's own step events drive it (``on_pre_optimizer_step``: after clipping, before the step;
    ``on_optimizer_step``: after it), so every rank counts every optimizer step, also one that fp16's loss scaler
    skipped on some ranks only; with that scaler DiLoCo leaves non-finite steps to it."""

    def __init__(self, trainer: Trainer, sync_every: int | str = 10, method: str = "diloco", **settings: Any) -> None:
        if method_named(method).every_step:  # averaging gradients every step is the Trainer's own DDP
            raise ValueError(
                f"method={method!r} is what the Trainer does by itself under torchrun; use it without adloco"
            )
        self.trainer = trainer
        self.settings = {"sync_every": sync_every, "method": method, **settings}
        self.diloco: DiLoCo | None = None
        self.inner: torch.optim.Optimizer | None = None
        self._data_moved: _DataMoved | None = None  # where a heal at the start moved the Trainer's data

    def on_train_begin(self, args: Any, state: Any, control: Any, model=None, optimizer=None, **kwargs: Any) -> None:
        processes = self.trainer.accelerator.num_processes
        check_replica_launch(self.settings, processes, "Trainer")
        keep_gradients_local(self.trainer.model_wrapped, processes)
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        scaled = getattr(self.trainer.accelerator, "scaler", None) is not None
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        mine = self._saved(folder) if state.global_step > 0 else None  # resumed from the Trainer's checkpoint
        replica = is_replica(self.settings)
        if mine is not None and replica:  # its own state before its first quorum, where peers further on heal it
            model.load_state_dict(mine["model"])
        start = mine["diloco"] if mine is not None and replica else None
        self.diloco = DiLoCo(model, self.inner, check_finite=not scaled, state=start, **self.settings)
        if mine is not None and not replica:
            model.load_state_dict(mine["model"])  # DiLoCo's start gave every rank θ: each takes its own model back
            self.diloco.load_state_dict(mine["diloco"])
        began, self._data_moved = state.global_step, None
        self._follow_heal(state, control)
        if state.global_step > began and kwargs.get("train_dataloader") is not None:
            self._data_moved = _DataMoved.to_step(kwargs["train_dataloader"], began, state.global_step, args)

    def _saved(self, folder: Path) -> dict[str, Any]:
        """This rank's state beside the Trainer's checkpoint, its inner optimizer loaded from it (the Trainer
        restored rank 0's on every rank; within a round each rank has its own)."""
        assert self.inner is not None
        ft = self.settings.get("fault_tolerance")
        rank = ft["replica"] if ft is not None else (dist.get_rank() if dist.is_initialized() else 0)
        saved = folder / STATE_FILE.format(rank=rank)
        if not saved.exists():
            raise FileNotFoundError(
                f"resuming at step {folder.name.split('-')[-1]}, DiLoCo needs this rank's state in '{saved}' (written "
                "beside every checkpoint of the Trainer's output_dir); resume from a checkpoint of that folder"
            )
        mine = torch.load(saved, weights_only=True)
        self.inner.load_state_dict(mine["optimizer"])
        return mine

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.diloco is not None
        self.diloco.before_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.diloco is not None
        self.diloco.step()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._data_moved is not None:
            self._data_moved.skipped.batches = 0  # the skip is behind it: the next epochs read from their start

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._data_moved is not None:  # the Trainer counts epochs from where its loop began, not the job's
            state.epoch += self._data_moved.epochs_ahead
        self._follow_heal(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._data_moved is not None:
            self._data_moved.epoch_ended(args)

    def _follow_heal(self, state: Any, control: Any) -> None:
        """A replica that healed from a peer goes on from the peers' step: the Trainer's too, with its schedule."""
        behind = steps_behind(self.diloco, state.global_step)
        if behind:
            state.global_step += behind
            advance_schedules([self.trainer.lr_scheduler], behind)
            if state.global_step >= state.max_steps:
                control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, model=None, **kwargs: Any) -> None:
        assert self.diloco is not None and self.inner is not None
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        mine = {"model": model.state_dict(), "optimizer": self.inner.state_dict(), "diloco": self.diloco.state_dict()}
        torch.save(mine, folder / STATE_FILE.format(rank=self.diloco.rank))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._data_moved is not None:  # training ended within its first epoch: the user's setting back
            self._data_moved.epoch_ended(args)
        if self.diloco is not None:
            # the model is θ for trainer.save_model and evaluation, unless the Trainer just loaded its best checkpoint
            self.diloco.finish(into_model=not args.load_best_model_at_end)


class _DataMoved:
    """The Trainer's data moved to where a replica that never stopped reads at the job's step, after a heal at
    training's start: its sampler's epochs shifted by the epochs between the Trainer's first epoch (its own step's,
    after a resume) and the job's, and the job's epoch entered ``batches`` batches in."""

    def __init__(self, skipped: SkippedBatches, shift: int, fraction: float, ignore_data_skip: bool) -> None:
        self.skipped, self.shift, self.epochs_ahead = skipped, shift, shift + fraction
        self.ignore_data_skip = ignore_data_skip  # the user's, put back after the first epoch

    @classmethod
    def to_step(cls, loader: Any, began: int, step: int, args: Any) -> _DataMoved | None:
        if began > 0 and not hasattr(Trainer, "_run_epoch"):  # before transformers 5 a resume skips its own batches
            cannot_skip("Trainer", "resumed from a checkpoint, before transformers 5", "on from its checkpoint's place")
            return None
        accumulation = args.gradient_accumulation_steps
        batches = len(loader) if has_length(loader) else None
        per_epoch = steps_per_epoch(batches, accumulation) if batches else args.max_steps
        epoch, into = data_position(step, per_epoch, accumulation)
        if into and batches and batches % accumulation:  # the Trainer closes that short step by its count from 0
            cannot_skip("Trainer", "gradient accumulation with a short last step per epoch")
            into = 0
        base = getattr(loader, "base_dataloader", loader)  # accelerate's adapter iterates the DataLoader it holds
        skipped = skip_batches(base, into, "Trainer")
        if skipped is None:
            return None
        shift = epoch - began // per_epoch
        shift_sampler_epochs(getattr(skipped.batch_sampler, "sampler", None), shift)
        moved = cls(skipped, shift, into / batches if batches else 0.0, args.ignore_data_skip)
        if began > 0:  # resumed: the Trainer would enter its first epoch at its checkpoint's batch, behind the job's
            args.ignore_data_skip = True
        return moved

    def epoch_ended(self, args: Any) -> None:
        self.epochs_ahead = self.shift
        args.ignore_data_skip = self.ignore_data_skip


def use_diloco(trainer: Trainer, sync_every: int | str = 10, method: str = "diloco", **settings: Any) -> DiLoCoCallback:
    """Make ``trainer``'s next ``train()`` DiLoCo; returns the callback (its ``.diloco`` once training began)."""
    callback = DiLoCoCallback(trainer, sync_every, method, **settings)
    trainer.args.average_tokens_across_devices = False  # a collective every step, and each worker's loss rescaled
    trainer.add_callback(callback)
    return callback
