"""Which rows of a parameter each shard of a sharded worker holds: FSDP2's layout, dim 0 cut by ``torch.chunk``.

A tensor of n rows cut into S shards gives shard s the rows [s·c, min(n, (s+1)·c)) with c = ⌈n / S⌉; a shard past
the end holds no rows. The sync strategies, the trainer's θ and the outer optimizer work on these local rows, and
a checkpoint written by S shards is cut anew for another shard count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardLayout:
    """Which shard of its workers a rank holds (``index`` of ``count``), and the model's parameter shapes, asked
    for only when a checkpoint of another shard count must be cut anew."""

    index: int = 0
    count: int = 1
    shapes: Callable[[], set[tuple[int, ...]]] | None = None


UNSHARDED = ShardLayout()


def shard_rows(rows: int, index: int, count: int) -> tuple[int, int]:
    """The rows [start, stop) that shard ``index`` of ``count`` holds of a tensor with ``rows`` rows."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count} does not exist")
    chunk = -(-rows // count)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk)


def local_shard(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Shard ``index`` of ``count`` of ``tensor`` (a copy that owns its memory; the tensor itself for one shard)."""
    if count == 1:
        return tensor
    start, stop = shard_rows(tensor.size(0), index, count)
    return tensor[start:stop].clone()


def shard_shape(shape: Sequence[int], index: int, count: int) -> tuple[int, ...]:
    start, stop = shard_rows(shape[0], index, count)
    return (stop - start, *shape[1:])


def join_shards(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from all of its shards, in shard order."""
    return torch.cat(list(shards), dim=0)


def recut(columns: Sequence[Any], index: int, count: int, shapes: set[tuple[int, ...]]) -> Any:
    """One rank's state for shard ``index`` of ``count`` from the same state saved by ``len(columns)`` shards (one
    state per old shard, alike in structure): a float tensor whose pieces join into the shape of a parameter is a
    parameter's rows (θ, a moment, a pseudo-gradient in flight) and is cut anew; anything else is the same on every
    shard (counters, data streams) and is taken from the first."""
    first = columns[0]
    if torch.is_tensor(first):
        alike = all(torch.is_tensor(c) and c.dim() == first.dim() and c.shape[1:] == first.shape[1:] for c in columns)
        if first.is_floating_point() and first.dim() > 0 and alike:
            whole = join_shards(columns) if len(columns) > 1 else first
            if tuple(whole.shape) in shapes:
                return local_shard(whole, index, count)
        return first
    if isinstance(first, dict):
        return {key: recut([c[key] for c in columns], index, count, shapes) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(recut([c[i] for c in columns], index, count, shapes) for i in range(len(first)))
    return first


def local_rows(tensor: Any) -> Any:
    """This rank's rows of a sharded tensor (an FSDP2 DTensor); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_like(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (this rank's part) laid out as ``param`` is: a DTensor sharded alike, or ``rows`` itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return rows
    return DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
