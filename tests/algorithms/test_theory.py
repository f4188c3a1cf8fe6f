"""Exact values and limits of the rounds-to-target theory (hand-computed)."""

import math

import pytest

from adloco.algorithms.theory import (
    LinearInLoss,
    calibrate_scale,
    fit_linear_in_loss,
    noise_scale,
    norm_test_batch,
    progress_per_round,
    rounds_to_target,
    step_efficiency,
)


def test_noise_scale_values_and_limits():
    assert noise_scale(4.0, 12.0) == 3.0
    assert noise_scale(3.0, 0.0) == 0.0  # no noise: any batch is as good as an infinite one
    assert noise_scale(0.0, 5.0) == math.inf  # no signal: never a division by zero
    assert noise_scale(-1.0, 5.0) == math.inf
    with pytest.raises(ValueError, match="sample_variance"):
        noise_scale(1.0, -1.0)
    with pytest.raises(ValueError, match="grad_norm_sq"):
        noise_scale(math.nan, 1.0)


def test_step_efficiency():
    assert step_efficiency(3, 3.0) == 0.5
    assert step_efficiency(4, 0.0) == 1.0
    assert step_efficiency(4, math.inf) == 0.0
    assert step_efficiency(1e15, 3.0) == pytest.approx(1.0, abs=1e-12)  # B → ∞
    with pytest.raises(ValueError, match="batch"):
        step_efficiency(0, 1.0)


def test_progress_per_round_hand_computed():
    # κ·H·G/(1 + B_noise/B) = 0.5 · 10 · 4 / (1 + 3/3) = 10
    assert progress_per_round(4.0, 12.0, batch=3, steps=10, scale=0.5) == pytest.approx(10.0, rel=1e-15)
    # zero variance and B → ∞ both give the noise-free κ·H·G = 20
    assert progress_per_round(4.0, 0.0, batch=3, steps=10, scale=0.5) == 20.0
    assert progress_per_round(4.0, 12.0, batch=1e15, steps=10, scale=0.5) == pytest.approx(20.0, rel=1e-12)
    # a non-positive ‖∇F‖² estimate predicts no progress
    assert progress_per_round(0.0, 12.0, batch=3, steps=10) == 0.0
    assert progress_per_round(-2.0, 12.0, batch=3, steps=10) == 0.0
    # doubling the batch in the noise-dominated regime nearly doubles progress; with no noise it changes nothing
    small, large = (progress_per_round(1.0, 1000.0, batch=b, steps=1) for b in (4, 8))
    assert large / small == pytest.approx(2.0, rel=0.01)
    assert progress_per_round(1.0, 0.0, batch=8, steps=1) == progress_per_round(1.0, 0.0, batch=4, steps=1)


def test_calibrate_scale():
    assert calibrate_scale(2.0, [1.0, 3.0]) == 0.5
    with pytest.raises(ValueError, match="no predicted progress"):
        calibrate_scale(2.0, [0.0, 0.0])
    with pytest.raises(ValueError, match="did not fall"):
        calibrate_scale(-0.1, [1.0])


def test_fit_linear_in_loss():
    line = fit_linear_in_loss([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert line.slope == pytest.approx(2.0) and line.intercept == pytest.approx(0.0, abs=1e-12)
    assert line.zero_at == pytest.approx(0.0, abs=1e-12)
    assert line(0.5) == pytest.approx(1.0) and line(-1.0) == 0.0  # floored at zero
    flat = fit_linear_in_loss([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], slope=False)
    assert flat == LinearInLoss(4.0, 0.0) and flat.zero_at == -math.inf
    assert fit_linear_in_loss([2.0], [5.0]) == LinearInLoss(5.0, 0.0)
    assert LinearInLoss(-1.0, 0.0).zero_at == math.inf  # zero everywhere
    assert LinearInLoss(1.0, -0.5).zero_at == -math.inf  # grows as the loss falls: never vanishes below
    with pytest.raises(ValueError):
        fit_linear_in_loss([], [])


def test_norm_test_batch():
    assert norm_test_batch(1.0, 10.0, workers=2, eta=1.0, current=1, cap=64) == 5  # ⌈10/(2·1·1)⌉
    assert norm_test_batch(1.0, 10.0, workers=2, eta=1.0, current=8, cap=64) == 8  # monotone
    assert norm_test_batch(1.0, 1000.0, workers=1, eta=1.0, current=1, cap=64) == 64
    assert norm_test_batch(0.0, 10.0, workers=1, eta=1.0, current=1, cap=64) == 64  # noise-dominated


def test_rounds_to_target_geometric_without_noise():
    # G(L) = L − 1, σ² = 0, κ·H = 0.1: the excess loss shrinks by 0.9 per round. From excess 2 to 0.5 needs
    # 0.9ⁿ ≤ 0.25, n = ⌈log 0.25 / log 0.9⌉ = ⌈13.16⌉ = 14.
    prediction = rounds_to_target(
        3.0,
        1.5,
        scale=0.05,
        steps=2,
        workers=1,
        batch=1,
        grad_norm_sq=LinearInLoss(-1.0, 1.0),
        sample_variance=LinearInLoss(0.0),
    )
    assert prediction.rounds == 14 and prediction.reachable
    assert prediction.losses[0] == pytest.approx(2.8)
    assert prediction.losses[-1] == pytest.approx(1.0 + 2.0 * 0.9**14)
    assert prediction.losses[-2] > 1.5 >= prediction.losses[-1]


def test_rounds_to_target_constant_statistics_with_noise():
    # G = 2, σ² = 6, M·b = 2: B_noise = 3, efficiency 0.4; drop 0.25 · 4 · 2 · 0.4 = 0.8 per round;
    # 2.5 / 0.8 = 3.125 → 4 rounds.
    prediction = rounds_to_target(
        5.0,
        2.5,
        scale=0.25,
        steps=4,
        workers=2,
        batch=1,
        grad_norm_sq=LinearInLoss(2.0),
        sample_variance=LinearInLoss(6.0),
    )
    assert prediction.rounds == 4
    assert prediction.losses == pytest.approx((4.2, 3.4, 2.6, 1.8))
    assert prediction.batches == (1, 1, 1, 1)


def test_rounds_to_target_follows_the_norm_test():
    # G = 1, σ² = 8, M = 1, η = 1: round 1 at b = 1 drops 1/9, then b = ⌈8⌉ capped at 4 drops 1/3 per round;
    # 1/9 + n/3 ≥ 1 gives n = 3, so 4 rounds.
    prediction = rounds_to_target(
        1.0,
        0.0,
        scale=1.0,
        steps=1,
        workers=1,
        batch=1,
        grad_norm_sq=LinearInLoss(1.0),
        sample_variance=LinearInLoss(8.0),
        eta=1.0,
        batch_cap=4,
    )
    assert prediction.rounds == 4
    assert prediction.batches == (1, 4, 4, 4)


def test_rounds_to_target_edge_cases():
    common = {"scale": 0.1, "steps": 1, "workers": 1, "batch": 1, "sample_variance": LinearInLoss(1.0)}
    line = LinearInLoss(-1.0, 1.0)  # ‖∇F‖² vanishes at L = 1
    assert rounds_to_target(2.0, 2.5, grad_norm_sq=line, **common).rounds == 0  # already there
    assert rounds_to_target(2.0, 2.0, grad_norm_sq=line, **common).rounds == 0
    for target in (1.0, 0.5):  # at or below where progress stops: a clear "unreachable", no division by zero
        below = rounds_to_target(2.0, target, grad_norm_sq=line, **common)
        assert below.rounds is None and not below.reachable and "vanishes" in below.reason
    slow = rounds_to_target(2.0, 1.0001, grad_norm_sq=line, max_rounds=50, **common)
    assert slow.rounds is None and "50 rounds" in slow.reason and len(slow.losses) == 50
    nothing = rounds_to_target(2.0, 1.0, grad_norm_sq=LinearInLoss(0.0), **common)
    assert nothing.rounds is None
    with pytest.raises(ValueError, match="scale"):
        rounds_to_target(2.0, 1.0, grad_norm_sq=line, **{**common, "scale": 0.0})
    with pytest.raises(ValueError, match="eta and batch_cap"):
        rounds_to_target(2.0, 1.0, grad_norm_sq=line, eta=1.0, **common)
