"""The time-aware batch controller: cost fit, the fastest batch, and how b moves towards it."""

import math

import pytest

from adloco.algorithms.controller import (
    StepCost,
    TimeAwareController,
    fastest_batch,
    fit_step_cost,
    noise_scale,
    seconds_per_progress,
)


def test_the_cost_line_fits_exact_points_and_stays_non_negative():
    line = fit_step_cost([(1, 0.012), (4, 0.018), (16, 0.042)])
    assert (line.overhead, line.per_sample) == pytest.approx((0.010, 0.002))
    assert fit_step_cost([(8, 0.4)]) == StepCost(0.0, 0.05)  # one batch timed: all of it per sample
    flat = fit_step_cost([(1, 0.5), (8, 0.4)])  # noise made larger batches look cheaper: no negative slope
    assert flat.per_sample == 0.0 and flat.overhead == pytest.approx(0.45)
    through_origin = fit_step_cost([(2, 0.01), (4, 0.03)])  # a negative intercept: the line through 0
    assert through_origin.overhead == 0.0 and through_origin.per_sample > 0
    with pytest.raises(ValueError):
        fit_step_cost([])


def test_the_fastest_batch_is_the_closed_form_optimum():
    # (1 + N/(M b)) (a + c b + T/H) is least at b* = sqrt(N (a + T/H) / (M c))
    cost, n, m, t, h = StepCost(0.02, 0.001), 50.0, 2, 0.4, 10
    exact = math.sqrt(n * (0.02 + t / h) / (m * 0.001))  # = 25.5
    best = fastest_batch(n, m, cost, t, h, 1, 1000)
    assert best in (math.floor(exact), math.ceil(exact))
    assert seconds_per_progress(best, m, n, cost, t, h) <= seconds_per_progress(best + 5, m, n, cost, t, h)
    # a slower link (larger T) and a larger noise scale both ask for larger batches; a cap bounds them
    assert fastest_batch(n, m, cost, 4.0, h, 1, 1000) > best < fastest_batch(4 * n, m, cost, t, h, 1, 1000)
    assert fastest_batch(n, m, cost, t, h, 1, 8) == 8 and fastest_batch(math.inf, m, cost, t, h, 1, 64) == 64


def test_noise_scale_is_inf_when_the_gradient_is_noise_only():
    assert noise_scale(4.0, 0.5) == 8.0
    assert noise_scale(4.0, 0.0) == math.inf and noise_scale(4.0, -1e-3) == math.inf


def _decide(controller, b, noise=400.0, limit=None):
    return controller.decide(noise, 1, b, StepCost(0.02, 0.001), 0.0, 10, limit)


def test_b_moves_after_patience_decisions_and_at_most_doubles():
    controller = TimeAwareController(b_min=1, b_cap=256, patience=2)
    assert _decide(controller, 3).b_req == 3  # the first decision pointing up only counts
    second = _decide(controller, 3)
    assert second.b_req == 6 and second.target > 6  # doubled, not jumped to the target
    assert _decide(controller, 6).b_req == 6 and _decide(controller, 6).b_req == 12
    # a decision pointing elsewhere resets the count
    controller = TimeAwareController(b_min=1, b_cap=256, patience=2)
    _decide(controller, 3)
    assert _decide(controller, 3, noise=1e-6).b_req == 3 and _decide(controller, 3).b_req == 3


def test_b_stays_within_the_cap_and_the_budgets_limit_and_shrinks_only_when_allowed():
    controller = TimeAwareController(b_min=1, b_cap=5, patience=1)
    assert _decide(controller, 4).b_req == 5
    limited = TimeAwareController(b_min=1, b_cap=256, patience=1)
    decision = _decide(limited, 4, limit=6)
    assert decision.b_req == 6 and decision.limit == 6
    assert _decide(limited, 16, noise=0.1).b_req == 16  # monotone by default
    shrinking = TimeAwareController(b_min=1, b_cap=256, patience=1, allow_shrink=True)
    assert _decide(shrinking, 16, noise=0.1).b_req == 8  # halves at most
    with pytest.raises(ValueError):
        TimeAwareController(b_min=4, b_cap=2)


def test_the_controller_state_round_trips():
    controller = TimeAwareController(b_min=1, b_cap=256, patience=3)
    _decide(controller, 3)
    restored = TimeAwareController(b_min=1, b_cap=256, patience=3)
    restored.load_state_dict(controller.state_dict())
    assert _decide(restored, 3) == _decide(controller, 3)
