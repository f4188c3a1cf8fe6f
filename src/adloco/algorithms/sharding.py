"""Which rows of a parameter each shard of a sharded worker holds: FSDP2's layout, dim 0 cut by ``torch.chunk``.

A tensor of n rows cut into S shards gives shard s the rows [s·c, min(n, (s+1)·c)) with c = ⌈n / S⌉; a shard past
the end holds no rows. The sync strategies, the trainer's θ and the outer optimizer work on these local rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shard_rows(rows: int, index: int, count: int) -> tuple[int, int]:
    """The rows [start, stop) that shard ``index`` of ``count`` holds of a tensor with ``rows`` rows."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count} does not exist")
    chunk = -(-rows // count)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk)


def local_shard(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Shard ``index`` of ``count`` of ``tensor`` (a copy, so it owns its memory)."""
    start, stop = shard_rows(tensor.size(0), index, count)
    return tensor[start:stop].clone()


def shard_shape(shape: Sequence[int], index: int, count: int) -> tuple[int, ...]:
    start, stop = shard_rows(shape[0], index, count)
    return (stop - start, *shape[1:])


def join_shards(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from all of its shards, in shard order."""
    return torch.cat(list(shards), dim=0)
