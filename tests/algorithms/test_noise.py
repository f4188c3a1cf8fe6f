"""Noise scale and batch-gradient deviation: exact values on test vector 5 of docs/design.md and exhaustive subsets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from adloco.algorithms.batch_tests import (
    BatchSizeController,
    norm_test_request,
    statistics_from_gram,
    statistics_from_samples,
)
from adloco.algorithms.noise import (
    batch_deviations,
    finite_population_factor,
    gram_of_rows,
    predicted_deviation,
    simple_noise_scale,
)

VECTOR5 = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)


def exhaustive_mean_deviation(rows: torch.Tensor, batch: int) -> float:
    """Mean of ‖g_B − g‖²/‖g‖² over every subset of ``batch`` rows, straight from the vectors."""
    g = rows.mean(dim=0)
    values = [
        float(((rows[list(s)].mean(dim=0) - g) ** 2).sum()) for s in itertools.combinations(range(len(rows)), batch)
    ]
    return math.fsum(values) / len(values) / float(g @ g)


def test_vector5_noise_scale_and_norm_test():
    stats = statistics_from_gram(gram_of_rows(VECTOR5), [1] * 4)
    assert stats.grad_norm_sq == pytest.approx(1.0, abs=1e-15)
    assert stats.sample_variance == pytest.approx(4 / 3, abs=1e-15)
    assert simple_noise_scale(stats.sample_variance, stats.grad_norm_sq) == pytest.approx(4 / 3, abs=1e-15)
    # The norm test on the same statistics (textbook ‖g‖²): 16/3 -> 6.
    assert norm_test_request(stats, workers=1, eta=0.5, unbiased=False) == pytest.approx(16 / 3, abs=1e-12)


def test_vector5_exact_deviation_for_pairs():
    # Pairs: {0,1} and {2,3} average to g exactly, the other four deviate by 0.5: mean 1/3 =
    # tr Cov / (B ‖g‖²) · (1 − B/N) = (4/3)/2 · 1/2.
    assert exhaustive_mean_deviation(VECTOR5, 2) == pytest.approx(1 / 3, abs=1e-15)
    assert predicted_deviation(4 / 3, 1.0, 2, population=4) == pytest.approx(1 / 3, abs=1e-15)
    assert predicted_deviation(4 / 3, 1.0, 2) == pytest.approx(2 / 3, abs=1e-15)


def test_finite_population_factor():
    assert finite_population_factor(1, 4) == 0.75
    assert finite_population_factor(4, 4) == 0.0
    assert predicted_deviation(4 / 3, 1.0, 4, population=4) == 0.0
    with pytest.raises(ValueError, match="larger than the population"):
        finite_population_factor(5, 4)
    with pytest.raises(ValueError, match="batch must be"):
        predicted_deviation(1.0, 1.0, 0)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 7])
def test_prediction_equals_exhaustive_mean_on_random_vectors(batch):
    rows = torch.randn(8, 5, generator=torch.Generator().manual_seed(batch), dtype=torch.float64) + 0.7
    stats = statistics_from_samples(rows)
    predicted = predicted_deviation(stats.sample_variance, stats.grad_norm_sq, batch, population=8)
    assert exhaustive_mean_deviation(rows, batch) == pytest.approx(predicted, rel=1e-12)


def test_batch_deviations_match_direct_computation():
    rows = torch.randn(10, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.3
    g = rows.mean(dim=0)
    generator = torch.Generator().manual_seed(5)
    deviations = batch_deviations(gram_of_rows(rows), 3, 20, generator)
    # Replay the same draws and compute each batch mean from the vectors themselves.
    replay = torch.Generator().manual_seed(5)
    for value in deviations:
        chosen = torch.randperm(10, generator=replay)[:3]
        direct = float(((rows[chosen].mean(dim=0) - g) ** 2).sum()) / float(g @ g)
        assert float(value) == pytest.approx(direct, rel=1e-10, abs=1e-14)


def test_batch_deviations_converge_to_prediction():
    rows = torch.randn(32, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    stats = statistics_from_samples(rows)
    gram = gram_of_rows(rows)
    for batch in (1, 4, 16):
        mean = float(batch_deviations(gram, batch, 20000, torch.Generator().manual_seed(batch)).mean())
        predicted = predicted_deviation(stats.sample_variance, stats.grad_norm_sq, batch, population=32)
        assert mean == pytest.approx(predicted, rel=0.05)
    # The whole population has no deviation at all.
    assert float(batch_deviations(gram, 32, 3, torch.Generator()).abs().max()) < 1e-12


def test_gram_of_rows_chunks_agree_with_float64_product():
    rows = torch.randn(5, 37, generator=torch.Generator().manual_seed(3))
    exact = rows.double() @ rows.double().T
    assert torch.allclose(gram_of_rows(rows, chunk=4), exact, rtol=0, atol=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="mean gradient is zero"):
        batch_deviations(gram_of_rows(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])), 1, 2, torch.Generator())
    with pytest.raises(ValueError, match="repeats"):
        batch_deviations(gram_of_rows(VECTOR5), 1, 0, torch.Generator())
    with pytest.raises(ValueError, match="square"):
        batch_deviations(torch.zeros(2, 3), 1, 1, torch.Generator())
    assert simple_noise_scale(0.0, 0.0) == 0.0
    assert simple_noise_scale(1.0, 0.0) == math.inf


def test_controller_on_vector5_statistics_clamps_and_rounds():
    stats = statistics_from_gram(gram_of_rows(VECTOR5), [1] * 4)
    # The controller uses the unbiased ‖∇F‖² = 1 − (4/3)/4 = 2/3: 4/3 / (2/3) / 0.25 = 8.
    decision = BatchSizeController("norm", eta=0.5, b_cap=64, allow_shrink=True).decide(stats, 1, 1)
    assert decision.raw_request == pytest.approx(8.0, rel=1e-12)
    assert decision.b_req == 8
