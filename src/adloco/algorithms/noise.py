"""Gradient noise of a finite set of per-sample gradients: noise scale and batch-gradient deviation.

Setting: N per-sample gradients a_1 … a_N at one θ, their mean g, and tr Cov = Σ_i ‖a_i − g‖² / (N − 1)
(the 1/(N − 1) normalisation of :func:`adloco.algorithms.batch_tests.statistics_from_samples`). A batch of
B distinct samples drawn uniformly WITHOUT replacement from the N has mean g_B, and exactly

    E‖g_B − g‖² = tr Cov · (1 − B/N) / B,

the finite-population correction (1 − B/N) turning the with-replacement value tr Cov / B into 0 at B = N.
Divided by ‖g‖² this is the relative deviation the norm test bounds by η². The simple noise scale of
McCandlish et al. (2018) is B_simple = tr Cov / ‖g‖²: the batch at which that relative deviation is about 1.

Everything here works from the N×N Gram matrix G_ij = a_iᵀa_j (float64), so the per-sample gradients are
needed only once, and a batch's deviation is the quadratic form wᵀGw with w = 1_S/B − 1/N.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "batch_deviations",
    "finite_population_factor",
    "gram_of_rows",
    "predicted_deviation",
    "simple_noise_scale",
]


def _check_batch(batch: int, population: int | None) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if population is not None:
        if isinstance(population, bool) or not isinstance(population, int) or population < 2:
            raise ValueError(f"population must be an int >= 2, got {population!r}")
        if batch > population:
            raise ValueError(f"batch {batch} is larger than the population of {population} samples")


def finite_population_factor(batch: int, population: int) -> float:
    """1 − B/N: the factor by which sampling B of N without replacement shrinks the batch-mean variance."""
    _check_batch(batch, population)
    return 1.0 - batch / population


def simple_noise_scale(trace_cov: float, grad_norm_sq: float) -> float:
    """B_simple = tr Cov / ‖g‖² (McCandlish et al. 2018); ``inf`` when ‖g‖² is 0 and there is noise."""
    if not (math.isfinite(trace_cov) and trace_cov >= 0):
        raise ValueError(f"trace_cov must be finite and >= 0, got {trace_cov!r}")
    if not (math.isfinite(grad_norm_sq) and grad_norm_sq >= 0):
        raise ValueError(f"grad_norm_sq must be finite and >= 0, got {grad_norm_sq!r}")
    if trace_cov == 0.0:
        return 0.0
    return math.inf if grad_norm_sq == 0.0 else trace_cov / grad_norm_sq


def predicted_deviation(trace_cov: float, grad_norm_sq: float, batch: int, population: int | None = None) -> float:
    """Expected ‖g_B − g‖² / ‖g‖² for a batch of B: tr Cov / (B ‖g‖²), times 1 − B/N when ``population`` is given.

    Without ``population`` the batch is drawn with replacement (or from an infinite population).
    """
    _check_batch(batch, population)
    factor = 1.0 if population is None else finite_population_factor(batch, population)
    return simple_noise_scale(trace_cov, grad_norm_sq) / batch * factor if factor > 0 else 0.0


def gram_of_rows(rows: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """Gram matrix (float64, N×N) of the N rows of ``rows``, converted to float64 a column chunk at a time.

    Chunking keeps the float64 copy small when the rows are float32 gradients of a whole model.
    """
    if rows.dim() != 2 or rows.shape[0] < 1:
        raise ValueError(f"rows must be an N x d matrix with N >= 1, got shape {tuple(rows.shape)}")
    n, d = rows.shape
    gram = torch.zeros(n, n, dtype=torch.float64)
    for start in range(0, d, chunk):
        part = rows[:, start : start + chunk].detach().to(torch.float64)
        gram += part @ part.T
    return gram


def batch_deviations(gram: torch.Tensor, batch: int, repeats: int, generator: torch.Generator) -> torch.Tensor:
    """‖g_B − g‖² / ‖g‖² for ``repeats`` batches of ``batch`` distinct samples drawn uniformly without replacement.

    ``gram`` is the N×N Gram matrix of the per-sample gradients; g is their mean. Returns float64 of shape
    (repeats,). Raises ValueError when ‖g‖² is 0 (the ratio is undefined).
    """
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be square, got shape {tuple(gram.shape)}")
    n = gram.shape[0]
    _check_batch(batch, n)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    g = gram.to(torch.float64)
    grad_norm_sq = float(g.sum()) / (n * n)
    if not grad_norm_sq > 0.0:
        raise ValueError("the mean gradient is zero: relative deviations are undefined")
    # One random permutation per repeat; its first B entries are a uniform B-subset.
    chosen = torch.stack([torch.randperm(n, generator=generator)[:batch] for _ in range(repeats)])
    weights = torch.full((repeats, n), -1.0 / n, dtype=torch.float64)
    weights.scatter_add_(1, chosen, torch.full((repeats, batch), 1.0 / batch, dtype=torch.float64))
    deviation = ((weights @ g) * weights).sum(dim=1).clamp_min(0.0)  # wᵀGw; rounding can dip below 0
    return deviation / grad_norm_sq
