"""A DDP communication hook that communicates nothing: a user's loop or a framework that wraps the model in
``DistributedDataParallel`` under torchrun (the HF ``Trainer``, Lightning's DDP strategies) keeps its wrapper and code
paths, while each DiLoCo worker keeps its own gradients."""

from __future__ import annotations

import gc
import warnings
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


def keep_gradients_local(model: Any, world_size: int) -> None:
    """Give ``model``'s DDP wrapper the hook that leaves each rank's gradients its own (once). Where several ranks
    train and the model is in another wrapper that averages gradients (FSDP, DataParallel), refuse."""
    wrapper = getattr(model, "_orig_mod", model)  # torch.compile's module around the wrapper
    if isinstance(wrapper, DistributedDataParallel):
        if not getattr(wrapper, "_adloco_local_only", False):
            wrapper.register_comm_hook(None, local_only)
            wrapper._adloco_local_only = True
        return
    kind = type(wrapper).__name__
    if world_size > 1 and ("FullyShardedDataParallel" in kind or kind.startswith("FSDP") or kind == "DataParallel"):
        raise ValueError(
            f"the model is wrapped in {kind}, which averages gradients every step; DiLoCo works with "
            "DistributedDataParallel (a worker sharded over several ranks: FSDP2 in your own loop, docs/own-loop.md)"
        )


def local_model(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """The module DiLoCo trains when the user's model is still in ``DistributedDataParallel`` (given in it, or with a
    wrapper left around it): each such wrapper gets the hook that averages nothing, said in one warning, since its
    averaging every step would make the workers one (DDP, not DiLoCo). The wrapped module is returned."""
    wrappers = [model] if isinstance(model, DistributedDataParallel) else []
    inner = model.module if wrappers else model
    if world_size > 1 and not wrappers:
        # A wrapper the loop still calls holds the module; nothing on the module tells, so look once, at the start
        # (one pass over the heap's objects: about 20 ms in a process holding torch and a model), by type() rather
        # than isinstance(), which would ask a proxy object's own __class__.
        found = (o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel))
        wrappers = [o for o in found if o.module is inner]
    for wrapper in wrappers:
        if getattr(wrapper, "_adloco_local_only", False):
            continue  # an integration's wrapper, already local
        keep_gradients_local(wrapper, world_size)
        warnings.warn(
            "the model is in a DistributedDataParallel, which averages gradients every step: DiLoCo gave it a "
            "communication hook that keeps each rank's own, so each rank is a worker (its buffers still come from "
            "rank 0 at each forward)",
            stacklevel=3,
        )
    return inner
