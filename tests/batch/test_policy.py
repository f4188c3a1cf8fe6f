"""A trainer's adaptive batch: how the batch test's decision feeds the time-aware controller."""

import math

import pytest

from adloco.algorithms.batch_tests import BatchSizeController, GradientStatistics
from adloco.algorithms.controller import StepCost, TimeAwareController, fastest_batch, resolvable_noise_scale
from adloco.batch.pace import Pace
from adloco.batch.policy import TrainerBatch

COST = StepCost(0.03, 0.008)  # a step of b samples: 30 ms + 8 ms per sample
LIMIT = 33


def _trainer(b: int, ema: float = 0.0) -> TrainerBatch:
    controller = BatchSizeController("norm", ema=ema, b_cap=64)
    timed = TimeAwareController(b_min=1, b_cap=64, patience=1)
    return TrainerBatch(b, controller, timed)  # a trainer of 2 workers: decide(..., 2, ...)


def test_a_noise_scale_is_at_most_the_samples_it_was_measured_on():
    assert resolvable_noise_scale(4.0, 0.5, 12) == 8.0  # resolved: as measured
    assert resolvable_noise_scale(4.0, 0.5, 6) == 6.0
    # a gradient lost in the noise, or barely above it, is not an infinite noise scale
    assert resolvable_noise_scale(4.0, -1e-3, 12) == 12.0 and resolvable_noise_scale(4.0, 0.0, 12) == 12.0
    assert resolvable_noise_scale(4.0, 1e-12, 12) == 12.0


# ‖ḡ‖² below σ²/samples: the unbiased ‖∇F‖² estimate is negative, the gradient lost in the noise. The statistics
# count 7 samples per worker, not b = 5: the bound is the trainer's batch M·b, not what one worker measured.
NOISY = GradientStatistics(samples=7, grad_norm_sq=5.0, sample_variance=60.0)


@pytest.mark.parametrize("round_seconds", [0.0, 2.0])
def test_a_noise_dominated_round_does_not_aim_b_at_its_ceiling(round_seconds):
    assert NOISY.unbiased_grad_norm_sq < 0
    trainer = _trainer(5)
    trainer.decide(NOISY, 2, Pace(COST, round_seconds, 10, LIMIT))
    timed = trainer.last_timed
    assert timed.noise_scale == 10  # the trainer's 2 workers × b = 5
    assert timed.target == fastest_batch(10.0, 2, COST, round_seconds, 10, 1, LIMIT) < LIMIT
    # only a slow exchange makes a larger batch worth it when the noise is unresolved
    assert (timed.target > 5) == (round_seconds > 0) and trainer.size == max(5, min(timed.target, 10))


def test_smoothed_statistics_resolve_a_larger_noise_scale():
    trainer = _trainer(5, ema=0.5)  # an EMA of weight 0.5 spans about 3 rounds
    trainer.decide(NOISY, 2, Pace(COST, 0.0, 10, LIMIT))
    assert trainer.last_timed.noise_scale == pytest.approx(30.0)


def test_a_resolved_noise_scale_is_used_as_measured():
    trainer = _trainer(5)
    resolved = GradientStatistics(samples=5, grad_norm_sq=1.0, sample_variance=2.5)  # ‖∇F‖² = 0.5, B = 5
    trainer.decide(resolved, 2, Pace(COST, 0.0, 10, LIMIT))
    assert math.isclose(trainer.last_timed.noise_scale, 5.0)
