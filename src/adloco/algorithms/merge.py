"""Multi-instance training: which trainers merge, with what weights, and the weighted average itself."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

__all__ = ["merge_weights", "merged_batch_size", "select_merge_group", "weighted_average"]

MergePolicy = Literal["b_req", "pairwise_reference"]


def select_merge_group(b_req: Mapping[int, int], group_size: int = 2) -> list[int]:
    """Ids of the ``group_size`` trainers with the smallest b_req (ties: smaller id), sorted by id.

    When fewer trainers than ``group_size`` are left, all of them merge.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if len(b_req) < 2:
        raise ValueError(f"merging needs at least 2 trainers, got {len(b_req)}")
    ranked = sorted(b_req.items(), key=lambda item: (item[1], item[0]))
    return sorted(trainer_id for trainer_id, _ in ranked[:group_size])


def merged_batch_size(b_reqs: Iterable[int]) -> int:
    """The merged trainer keeps the largest b_req of its group."""
    values = list(b_reqs)
    if not values:
        raise ValueError("merged_batch_size needs at least one b_req")
    return max(values)


def _normalise(raw: Sequence[float]) -> list[float]:
    if not raw:
        raise ValueError("weights must not be empty")
    if any(not math.isfinite(w) or w < 0 for w in raw):
        raise ValueError(f"weights must be finite and >= 0, got {list(raw)}")
    total = math.fsum(raw)
    if total <= 0:
        raise ValueError(f"weights must not all be zero, got {list(raw)}")
    return [w / total for w in raw]


def merge_weights(policy: MergePolicy, b_reqs: Sequence[int], worker_counts: Sequence[int]) -> list[float]:
    """Normalised merge weights (summing to 1) for the trainers of one merge group.

    ``"b_req"`` (the paper's rule): w_j ∝ b_j, the per-worker batch request.
    ``"pairwise_reference"``: the weights of the reference AdLoCo code, which merges two trainers at a
    time with w_j ∝ demand_j = |workers_j| · b_j (just b_j for a trainer with no workers). That code only
    averages parameters: the surviving trainer keeps its own outer optimizer state and its own b, and
    the other trainer's momentum is dropped. Here the weights are generalised to any group size and are
    used by the caller for params and momentum alike.
    """
    if len(b_reqs) != len(worker_counts):
        raise ValueError(f"got {len(b_reqs)} b_reqs but {len(worker_counts)} worker counts")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in b_reqs):
        raise ValueError(f"b_reqs must be ints >= 1, got {list(b_reqs)}")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in worker_counts):
        raise ValueError(f"worker_counts must be ints >= 0, got {list(worker_counts)}")
    if policy == "b_req":
        return _normalise([float(b) for b in b_reqs])
    if policy == "pairwise_reference":
        return _normalise([float(m * b if m > 0 else b) for b, m in zip(b_reqs, worker_counts, strict=True)])
    raise ValueError(f"merge policy must be 'b_req' or 'pairwise_reference', got {policy!r}")


@torch.no_grad()
def weighted_average(
    tensors_per_trainer: Sequence[Sequence[torch.Tensor | None]], weights: Sequence[float]
) -> list[torch.Tensor | None]:
    """θ = Σ_j w_j θ_j / Σ_j w_j, tensor by tensor, for parameters or outer-momentum buffers.

    Weights are normalised first and the sum runs in float64 in trainer order, then is cast back to the
    input dtype. A None entry (a momentum buffer of a trainer whose outer optimizer has not stepped yet)
    counts as zeros: with torch SGD (dampening 0) a zero buffer and a missing one give the same next
    step. A position that is None for every trainer stays None.
    """
    if len(tensors_per_trainer) != len(weights):
        raise ValueError(f"got {len(tensors_per_trainer)} trainers but {len(weights)} weights")
    normalised = _normalise([float(w) for w in weights])
    lengths = {len(tensors) for tensors in tensors_per_trainer}
    if len(lengths) != 1:
        raise ValueError(f"trainers hold different numbers of tensors: {sorted(lengths)}")
    result: list[torch.Tensor | None] = []
    for position in zip(*tensors_per_trainer, strict=True):
        present = [t for t in position if t is not None]
        if not present:
            result.append(None)
            continue
        reference = present[0]
        if any(t.shape != reference.shape for t in present):
            raise ValueError(f"shape mismatch in merge: {[tuple(t.shape) for t in present]}")
        acc = torch.zeros(reference.shape, dtype=torch.float64, device=reference.device)
        for tensor, weight in zip(position, normalised, strict=True):
            if tensor is not None and weight != 0.0:
                # Multiply then add (no fused alpha) so the rounding is the textbook Σ w_j θ_j.
                acc.add_(tensor.to(torch.float64).mul(weight))
        result.append(acc.to(reference.dtype))
    return result
