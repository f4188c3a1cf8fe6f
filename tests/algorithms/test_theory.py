"""Exact values and limits of the rounds-to-target theory (hand-computed)."""

import math

import pytest

from adloco.algorithms.schedules import inner_lr
from adloco.algorithms.theory import (
    LossModel,
    Schedule,
    calibrate_scale,
    fit_scale,
    log_slope,
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


def test_norm_test_batch():
    assert norm_test_batch(1.0, 10.0, workers=2, eta=1.0, current=1, cap=64) == 5  # ⌈10/(2·1·1)⌉
    assert norm_test_batch(1.0, 10.0, workers=2, eta=1.0, current=8, cap=64) == 8  # monotone
    assert norm_test_batch(1.0, 1000.0, workers=1, eta=1.0, current=1, cap=64) == 64
    assert norm_test_batch(0.0, 10.0, workers=1, eta=1.0, current=1, cap=64) == 64  # noise-dominated


def test_log_slope():
    # G = e^{β L}: β = ln(G_a/G_b)/(L_a − L_b)
    assert log_slope(3.0, math.exp(3.0), 2.0, math.exp(2.0)) == pytest.approx(1.0, rel=1e-12)
    assert log_slope(2.0, math.exp(2.0), 3.0, math.exp(3.0)) == pytest.approx(1.0, rel=1e-12)  # order-free
    assert log_slope(3.0, 1.0, 2.0, 2.0) == 0.0  # G grew as the loss fell: held constant instead
    assert log_slope(3.0, -1.0, 2.0, 2.0) == 0.0 and log_slope(3.0, 1.0, 2.0, 0.0) == 0.0  # noise-dominated
    assert log_slope(2.0, 1.0, 2.0, 0.5) == 0.0  # no loss change: no slope
    with pytest.raises(ValueError, match="loss_a"):
        log_slope(math.nan, 1.0, 2.0, 1.0)


def test_loss_model():
    model = LossModel(scale=0.5, slope=2.0, ref_loss=3.0, ref_grad_norm_sq=4.0, sample_variance=12.0)
    assert model.grad_norm_sq(3.0) == 4.0
    assert model.grad_norm_sq(2.0) == pytest.approx(4.0 * math.exp(-2.0), rel=1e-15)
    # at the reference: κ·h·G·B/(B + σ²/G) = 0.5 · 10 · 4 · 3/(3 + 3) = 10
    assert model.drop(3.0, batch=3, weight=10.0) == pytest.approx(10.0, rel=1e-15)
    flat = LossModel(scale=0.5, slope=0.0, ref_loss=3.0, ref_grad_norm_sq=4.0, sample_variance=12.0)
    assert flat.grad_norm_sq(-50.0) == flat.grad_norm_sq(50.0) == 4.0
    assert math.isfinite(model.grad_norm_sq(1e6))  # no overflow far above the reference


def test_schedule_round_weight_matches_the_run_schedule():
    schedule = Schedule(peak=1e-3, minimum=1e-4, warmup_steps=4, total_tokens=1000, steps=5)
    # steps 0-4 of the warm-up: (1 + 2 + 3 + 4)/4 · peak, then step 4 on the cosine at 4·10/1000
    expected = sum(inner_lr(s, s * 10 / 1000, 1e-3, 1e-4, 4) for s in range(5)) / 1e-3
    assert schedule.round_weight(0, 0, 10) == pytest.approx(expected, rel=1e-15)
    cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * 0.04))  # = 0.99645, relative to the peak
    assert schedule.round_weight(0, 0, 10) == pytest.approx(0.25 + 0.5 + 0.75 + 1.0 + cosine, rel=1e-12)
    # past the token budget the learning rate stays at its minimum: h = H · min/peak
    assert schedule.round_weight(100, 1000, 10) == pytest.approx(0.5, rel=1e-12)
    assert schedule.round_weight(100, 5000, 10) == pytest.approx(0.5, rel=1e-12)


def _path(model: LossModel, start: float, batches: list[float], weights: list[float]) -> list[float]:
    losses = [start]
    for batch, weight in zip(batches, weights, strict=True):
        losses.append(losses[-1] - model.drop(losses[-1], batch, weight))
    return losses


def test_fit_scale_recovers_kappa():
    truth = LossModel(scale=0.03, slope=1.2, ref_loss=3.0, ref_grad_norm_sq=0.5, sample_variance=5.0)
    batches, weights = [12.0, 12.0, 24.0, 24.0], [6.0, 8.0, 10.0, 9.5]  # 5 losses: the median is one of them
    losses = _path(truth, 3.2, batches, weights)
    fitted = fit_scale(
        losses,
        batches,
        weights,
        slope=1.2,
        grad_norm_sq=truth.grad_norm_sq(sorted(losses)[2]),
        sample_variance=5.0,
    )
    assert fitted.scale == pytest.approx(0.03, rel=1e-7) and fitted.ref_loss == sorted(losses)[2]
    assert _path(fitted, 3.2, batches, weights) == pytest.approx(losses, rel=1e-9)
    with pytest.raises(ValueError, match="did not fall"):
        fit_scale([3.0, 3.1], [1.0], [1.0], slope=0.0, grad_norm_sq=1.0, sample_variance=1.0)
    with pytest.raises(ValueError, match="at least 2 losses"):
        fit_scale([3.0], [], [], slope=0.0, grad_norm_sq=1.0, sample_variance=1.0)
    with pytest.raises(ValueError, match="grad_norm_sq"):
        fit_scale([3.0, 2.0], [1.0], [1.0], slope=0.0, grad_norm_sq=0.0, sample_variance=1.0)


# A constant learning rate (no warm-up, minimum = peak): every round has h = H.
FLAT = Schedule(peak=1.0, minimum=1.0, warmup_steps=0, total_tokens=10**9, steps=4)
RUN = {"schedule": FLAT, "step": 0, "tokens": 0, "sample_tokens": 8.0}


def test_rounds_to_target_constant_statistics_with_noise():
    # G = 2, σ² = 6, M·b = 2: B_noise = 3, efficiency 0.4; drop 0.25 · 4 · 2 · 0.4 = 0.8 per round;
    # 2.5 / 0.8 = 3.125 → 4 rounds.
    model = LossModel(scale=0.25, slope=0.0, ref_loss=5.0, ref_grad_norm_sq=2.0, sample_variance=6.0)
    prediction = rounds_to_target(model, 5.0, 2.5, workers=2, batch=1, **RUN)
    assert prediction.rounds == 4 and prediction.reachable
    assert prediction.losses == pytest.approx((4.2, 3.4, 2.6, 1.8))
    assert prediction.batches == (1, 1, 1, 1)
    assert prediction.tokens == (64.0, 128.0, 192.0, 256.0)  # 4 steps × 2 samples × 8 tokens a round


def test_rounds_to_target_with_a_falling_gradient():
    # Without noise, G = e^{L}: L ← L − κ·H·e^{L}. Hand-iterated from L = 1 with κ·H = 0.1.
    model = LossModel(scale=0.025, slope=1.0, ref_loss=0.0, ref_grad_norm_sq=1.0, sample_variance=0.0)
    expected = [1.0]
    while expected[-1] > 0.2:
        expected.append(expected[-1] - 0.1 * math.exp(expected[-1]))
    prediction = rounds_to_target(model, 1.0, 0.2, workers=1, batch=1, **RUN)
    assert prediction.rounds == len(expected) - 1
    assert prediction.losses == pytest.approx(tuple(expected[1:]), rel=1e-12)
    # the steps shrink with G: each round makes less progress than the one before
    drops = [a - b for a, b in zip(expected[:-1], expected[1:], strict=True)]
    assert drops == sorted(drops, reverse=True)


def test_rounds_to_target_follows_the_norm_test():
    # G = 1, σ² = 8, M = 1, η = 1, κ·H = 1: round 1 at b = 1 drops 1/9, then b = ⌈8⌉ capped at 4 drops 1/3
    # per round; 1/9 + n/3 ≥ 1 gives n = 3, so 4 rounds, and the tokens follow the batch.
    model = LossModel(scale=0.25, slope=0.0, ref_loss=1.0, ref_grad_norm_sq=1.0, sample_variance=8.0)
    prediction = rounds_to_target(model, 1.0, 0.0, workers=1, batch=1, eta=1.0, batch_cap=4, **RUN)
    assert prediction.rounds == 4
    assert prediction.batches == (1, 4, 4, 4)
    assert prediction.tokens == (32.0, 160.0, 288.0, 416.0)
    # other trainers' samples add tokens but not progress
    other = rounds_to_target(model, 1.0, 0.0, workers=1, batch=1, eta=1.0, batch_cap=4, other_samples=2, **RUN)
    assert other.rounds == 4 and other.tokens[0] == 96.0


def test_rounds_to_target_edge_cases():
    model = LossModel(scale=0.1, slope=1.0, ref_loss=2.0, ref_grad_norm_sq=1.0, sample_variance=1.0)
    common = {"workers": 1, "batch": 1, **RUN}
    assert rounds_to_target(model, 2.0, 2.5, **common).rounds == 0  # already there
    assert rounds_to_target(model, 2.0, 2.0, **common).rounds == 0
    far = rounds_to_target(model, 2.0, -5.0, max_rounds=50, **common)
    assert far.rounds is None and not far.reachable and "not reached within 50 rounds" in far.reason
    assert len(far.losses) == 50 and far.losses[-1] > -5.0
    silent = LossModel(scale=0.1, slope=0.0, ref_loss=2.0, ref_grad_norm_sq=1.0, sample_variance=1.0)
    stalled = rounds_to_target(silent, 2.0, 1.0, **{**common, "schedule": Schedule(1.0, 0.0, 0, 1, 4), "tokens": 5})
    assert stalled.rounds is None and "no progress" in stalled.reason  # learning rate 0 past the budget
    with pytest.raises(ValueError, match="eta and batch_cap"):
        rounds_to_target(model, 2.0, 1.0, eta=1.0, **common)
    with pytest.raises(ValueError, match="workers"):
        rounds_to_target(model, 2.0, 1.0, **{**common, "workers": 0})
