"""A Hugging Face ``transformers.Trainer`` run made DiLoCo: ``use_diloco(trainer, sync_every=10)``.

Under torchrun the Trainer wraps the model in ``DistributedDataParallel``, which averages the gradients of every
backward; DiLoCo's workers must drift apart instead. The callback gives that DDP a communication hook that
communicates nothing (the model stays wrapped, so the Trainer's own code paths stay as they are), hooks the
torch optimizer inside the Trainer's, and hands θ back to the model when training ends, so ``trainer.save_model``
saves the model DiLoCo trained. Each optimizer step is one inner step (after gradient accumulation, and not
counted when a mixed-precision step is skipped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from adloco.api import DiLoCo
from adloco.integrations.ddp import keep_gradients_local

STATE_FILE = "adloco_diloco_rank{rank}.pt"  # in each of the Trainer's checkpoint folders, one per rank


class DiLoCoCallback(TrainerCallback):
    """DiLoCo (or ``method`` localsgd, streaming) for ``trainer``'s run; the settings are ``adloco.DiLoCo``'s."""

    def __init__(self, trainer: Trainer, sync_every: int = 10, method: str = "diloco", **settings: Any) -> None:
        if method == "ddp":
            raise ValueError("method='ddp' is what the Trainer does by itself under torchrun; use it without adloco")
        self.trainer = trainer
        self.settings = {"sync_every": sync_every, "method": method, **settings}
        self.diloco: DiLoCo | None = None
        self.inner: torch.optim.Optimizer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model=None, optimizer=None, **kwargs: Any) -> None:
        keep_gradients_local(self.trainer.model_wrapped)
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        self.diloco = DiLoCo(model, self.inner, **self.settings)
        self.diloco.__enter__()
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE.format(rank=self.diloco.rank)
        if state.global_step > 0 and saved.exists():  # a run resumed from the Trainer's checkpoint
            mine = torch.load(saved, weights_only=True)
            # The Trainer restored rank 0's model and optimizer on every rank; within a round each rank has its own.
            model.load_state_dict(mine["model"])
            self.inner.load_state_dict(mine["optimizer"])
            self.diloco.load_state_dict(mine["diloco"])

    def on_save(self, args: Any, state: Any, control: Any, model=None, **kwargs: Any) -> None:
        assert self.diloco is not None
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        mine = {"model": model.state_dict(), "optimizer": self.inner.state_dict(), "diloco": self.diloco.state_dict()}
        torch.save(mine, folder / STATE_FILE.format(rank=self.diloco.rank))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco.finish()  # the model is θ, for trainer.save_model and evaluation


def use_diloco(trainer: Trainer, sync_every: int = 10, method: str = "diloco", **settings: Any) -> DiLoCoCallback:
    """Make ``trainer``'s next ``train()`` DiLoCo; returns the callback (its ``.diloco`` once training began)."""
    callback = DiLoCoCallback(trainer, sync_every, method, **settings)
    trainer.add_callback(callback)
    return callback
