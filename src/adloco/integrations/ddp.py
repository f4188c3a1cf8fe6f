"""A DDP communication hook that communicates nothing: a framework that wraps the model in
``DistributedDataParallel`` under torchrun (the HF ``Trainer``, Lightning's DDP strategies) keeps its wrapper and code
paths, while each DiLoCo worker keeps its own gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def local_only(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that leaves each rank's gradients its own."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
local_only.__annotations__ = {
    "state": object,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def keep_gradients_local(model: Any) -> None:
    """Give ``model``, where it is a DDP wrapper, the hook that leaves each rank's gradients its own (once)."""
    if isinstance(model, DistributedDataParallel) and not getattr(model, "_adloco_local_only", False):
        model.register_comm_hook(None, local_only)
        model._adloco_local_only = True
