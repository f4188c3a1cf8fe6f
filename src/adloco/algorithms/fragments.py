"""Streaming DiLoCo: parameter fragments, their sync schedule, and local/global mixing."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import torch

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")


def layer_index(param_name: str) -> int | None:
    """The transformer block a parameter belongs to (``model.layers.3.…`` → 3), or None."""
    match = _BLOCK.search(param_name)
    return int(match.group(1)) if match else None


def assign_fragments(
    param_names: Sequence[str],
    num_fragments: int,
    mode: Literal["strided", "sequential"] = "strided",
    shared: Literal["first", "own"] = "first",
) -> list[list[int]]:
    """Parameter indices of each fragment.

    Blocks are dealt to fragments strided (block l → fragment l mod P) or in contiguous runs. Parameters
    outside every block (embeddings, final norm, head) join fragment 0 (``first``) or make up a fragment of
    their own (``own``): then they are fragment 0 and the blocks share the other P − 1 fragments (a model
    with no such parameters has nothing to put there, and ``own`` acts like ``first``). In a model without
    transformer blocks the top-level modules (the first part of each name) are the blocks. Every parameter is
    in exactly one fragment and no fragment is empty; a P that cannot achieve this raises ValueError.
    """
    if num_fragments < 1:
        raise ValueError(f"streaming.fragments must be >= 1, got {num_fragments}")
    if mode not in ("strided", "sequential"):
        raise ValueError(f"streaming.assignment must be 'strided' or 'sequential', got {mode!r}")
    if shared not in ("first", "own"):
        raise ValueError(f"streaming.shared must be 'first' or 'own', got {shared!r}")
    block_of = [layer_index(n) for n in param_names]
    if all(b is None for b in block_of):  # no transformer blocks: the top-level modules stand in for them, in order
        tops = list(dict.fromkeys(n.split(".")[0] for n in param_names))
        block_of = [tops.index(n.split(".")[0]) for n in param_names]
    blocks = sorted({i for i in block_of if i is not None})
    has_outside = any(b is None for b in block_of)
    block_fragments = num_fragments - 1 if shared == "own" and has_outside else num_fragments
    if block_fragments < 1 or block_fragments > max(len(blocks), 1):
        raise ValueError(
            f"streaming.fragments={num_fragments} does not fit a model with {len(blocks)} blocks"
            + (" (one fragment is taken by embeddings/head)" if block_fragments != num_fragments else "")
        )
    position = {block: k for k, block in enumerate(blocks)}

    def fragment_of_block(block: int) -> int:
        k = position[block]
        return k % block_fragments if mode == "strided" else k * block_fragments // len(blocks)

    offset = num_fragments - block_fragments
    fragments: list[list[int]] = [[] for _ in range(num_fragments)]
    for i, block in enumerate(block_of):
        fragments[0 if block is None else offset + fragment_of_block(block)].append(i)
    if any(not f for f in fragments):
        raise ValueError(f"streaming.fragments={num_fragments} leaves a fragment without parameters")
    return fragments


def mix(local: torch.Tensor, outer: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·local + (1 − α)·outer; α = 0 returns ``outer`` itself and α = 1 ``local`` (exact, no copy)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"streaming.alpha must be in [0, 1], got {alpha}")
    if alpha == 0:
        return outer
    if alpha == 1:
        return local
    return torch.lerp(outer, local, alpha)
