"""PyTorch Lightning training made DiLoCo: ``Trainer(callbacks=[DiLoCoCallback(sync_every=10)])``.

Lightning's DDP strategy wraps the module in ``DistributedDataParallel``; the callback gives that wrapper a hook
that communicates nothing, so each rank is a DiLoCo worker. Lightning computes the gradients inside
``optimizer.step`` (its closure), so the callback calls ``DiLoCo.before_step`` from ``on_before_optimizer_step``
(after backward, before clipping and the step) and hooks only the step's end (a step a loss scaler skipped is
closed at the next one, so every rank counts alike). Works with ``lightning`` or ``pytorch_lightning``, whichever
is installed (``lightning`` first); one optimizer, automatic optimization.
"""

from __future__ import annotations

from typing import Any

from adloco.api import DiLoCo
from adloco.integrations.ddp import keep_gradients_local

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl


class DiLoCoCallback(pl.Callback):
    """DiLoCo (or ``method`` localsgd, streaming) for the fit it is given to; the settings are ``adloco.DiLoCo``'s."""

    def __init__(self, sync_every: int = 10, method: str = "diloco", **settings: Any) -> None:
        if method == "ddp":
            raise ValueError("method='ddp' is Lightning's own DDP strategy; use it without adloco")
        self.settings = {"sync_every": sync_every, "method": method, **settings}
        self.diloco: DiLoCo | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"DiLoCo wraps one inner optimizer; configure_optimizers gave {len(trainer.optimizers)}")
        if trainer.global_step > 0:
            raise ValueError("resuming a Lightning fit with DiLoCo from its checkpoint is not supported yet")
        keep_gradients_local(trainer.strategy.model, trainer.world_size)
        self.diloco = DiLoCo(pl_module, trainer.optimizers[0], **self.settings).hook(before=False)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.diloco is not None:
            self.diloco.before_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco.finish()  # the module is θ, for saving and evaluation
