"""One flat buffer for a list of tensors and back: collectives and gradient statistics work on flat rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, concatenated in order into one 1-D tensor (a new buffer)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, in order (clone them to outlive a reused buffer)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    if offset != flat.numel():
        raise ValueError(f"a flat buffer of {flat.numel()} elements does not hold tensors of {offset} elements")
    return out


def finite_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """For each index of the tensors' leading dimension, whether all their elements there are finite.

    NaN and ±inf show in a row's minimum or maximum, so one reduction pass suffices (no full-size mask).
    """
    extremes = [torch.stack(torch.aminmax(t.flatten(1), dim=1)) for t in tensors]
    return torch.isfinite(torch.cat(extremes)).all(dim=0)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_MODULUS = (1 << 61) - 1  # a prime: the digest of the tensors in order stays below 2**61


def bits_digest(tensors: Sequence[torch.Tensor]) -> int:
    """A number that equal tensors (bit for bit) share on every device: each tensor's elements read as integers
    and summed exactly (integer sums do not depend on the order of reduction, unlike a float sum), combined in
    order. Tensors that differ anywhere almost surely differ in it."""
    sums = [
        torch.sum(t.detach().contiguous().view(_WORDS[t.element_size()]), dtype=torch.int64).reshape(1) for t in tensors
    ]
    digest = 0
    for value in torch.cat(sums).tolist() if sums else []:
        digest = (digest * 1_000_003 + value) % _DIGEST_MODULUS
    return digest
