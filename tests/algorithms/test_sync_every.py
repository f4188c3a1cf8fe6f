"""sync_every=auto's rule: the square-root H*, its bounds and pace, the lr phase and the dispersion guard."""

import math

import pytest

from adloco.algorithms.sync_every import (
    AutoSyncEvery,
    best_sync_every,
    dispersion,
    drift_for_workers,
    drift_scale,
    seconds_per_step,
)


def _rule(**changes):
    settings = dict(low=5, high=200, start=10, drift_steps=1000.0)
    return AutoSyncEvery(**{**settings, **changes})


def test_the_square_root_rule_minimises_the_stated_cost():
    t, c, drift = 0.04, 0.6, 1000.0
    best = best_sync_every(t, c, drift)
    assert best == pytest.approx(math.sqrt(1000 * 0.6 / 0.04))  # 122.5
    costs = {h: seconds_per_step(t, c, h, drift) for h in range(1, 400)}
    assert min(costs, key=costs.get) in (math.floor(best), math.ceil(best))
    assert best_sync_every(0.04, 0.0, drift) == 0.0  # a free exchange: sync every step
    assert best_sync_every(0.0, 0.6, drift) == math.inf  # no compute measured


def test_the_drift_scale_grows_as_the_lr_decays_and_is_capped():
    assert drift_scale(1000.0, 1.0) == 1000.0
    assert drift_scale(1000.0, 0.25) == 4000.0
    assert drift_scale(1000.0, 0.0) == drift_scale(1000.0, 0.05) == 20000.0
    assert drift_scale(1000.0, 3.0) == 1000.0  # above the peak (never, but bounded)
    assert drift_scale(1000.0, 0.1, max_stretch=4.0) == 4000.0
    assert drift_scale(1000.0, 0.1, max_stretch=1.0) == 1000.0  # a fixed H_d, whatever the lr


def test_the_lr_power_sets_how_steeply_the_drift_scale_follows_the_lr():
    assert drift_scale(1000.0, 0.25, power=2.0) == 16000.0  # H* then grows as peak/lr: twice the sqrt rule's 2x
    assert drift_scale(1000.0, 0.25, power=0.0) == 1000.0
    assert drift_scale(1000.0, 0.25, power=-1.0) == 250.0  # rounds shorten as the lr decays
    assert drift_scale(1000.0, 0.01, max_stretch=4.0, power=2.0) == 16000.0  # the lr read as 1/4 of its peak
    assert drift_scale(1000.0, 1.0, power=3.0) == 1000.0  # at the peak every power agrees
    targets = {}
    for power in (1.0, 2.0, -1.0):
        rule = _rule(lr_power=power, high=1000)
        rule.observe(0.04, 0.6)
        targets[power] = rule.decide(0.25).target
    assert targets[1.0] == pytest.approx(2 * 122.47, abs=0.1)  # sqrt(1000 / 0.25 · 0.6 / 0.04)
    assert targets[2.0] == pytest.approx(4 * 122.47, abs=0.1)
    assert targets[-1.0] == pytest.approx(122.47 / 2, abs=0.1)


def test_the_drift_scale_falls_as_more_workers_are_averaged():
    assert drift_for_workers(400.0, 2, 1.0) == 400.0  # drift_steps is the scale of two workers
    assert drift_for_workers(400.0, 4, 1.0) == 200.0
    assert drift_for_workers(400.0, 1, 1.0) == 800.0  # one worker per trainer: nothing to drift apart from but θ
    assert drift_for_workers(400.0, 8, 2.0) == 25.0
    assert drift_for_workers(400.0, 4, 0.0) == 400.0


def test_the_lr_stretch_bounds_how_far_a_decayed_lr_lengthens_rounds():
    decided = {}
    for stretch in (20.0, 4.0, 1.0):
        rule = _rule(lr_stretch=stretch, high=1000)
        rule.observe(0.04, 0.6)
        rule.sync_every, rule.settled = 122, True  # at H* for the peak lr: only the lr phase moves it
        decided[stretch] = rule.decide(0.01)
    assert decided[20.0].sync_every == 244  # H* = sqrt(20) × 122 = 548, held to twice the last H
    assert decided[20.0].drift_steps == 20000.0 and decided[20.0].target == pytest.approx(547.7, abs=0.1)
    assert decided[4.0].sync_every == 244 and decided[4.0].drift_steps == 4000.0  # H* = 245
    assert decided[1.0].sync_every == 122 and decided[1.0].reason == "hold"
    with pytest.raises(ValueError):
        _rule(lr_stretch=0.5)


def test_dispersion_is_the_outer_norm_test():
    # Two workers with Δ = (1, 0) and (0, 1): mean (0.5, 0.5), ‖Δ̄‖² = 0.5, mean ‖Δ_i‖² = 1 -> δ = (2 - 1) / 1
    assert dispersion({0: 1.0, 1: 1.0}, 0.5) == pytest.approx(1.0)
    # identical workers: δ = 0; opposite ones: the mean is tiny and δ huge
    assert dispersion({0: 4.0, 1: 4.0, 2: 4.0}, 4.0) == 0.0
    assert dispersion({0: 1.0, 1: 1.0}, 1e-6) > 1e5
    # weights: worker 1 counts three times
    assert dispersion({0: 1.0, 1: 5.0}, 2.0, {0: 0.5, 1: 1.5}) == pytest.approx((4.0 / 2.0 - 1.0) / 1)
    assert math.isnan(dispersion({0: 1.0}, 1.0)) and math.isnan(dispersion({0: 1.0, 1: 1.0}, 0.0))


def test_h_waits_for_a_measurement_goes_to_h_star_then_moves_at_most_twofold_per_round():
    rule = _rule()
    first = rule.decide(1.0)
    assert (first.sync_every, first.reason) == (10, "measuring")
    rule.observe(0.04, math.nan)  # the first round has no overhead of a previous one
    assert rule.decide(1.0).reason == "measuring"
    seen = []
    for _ in range(3):
        rule.observe(0.04, 0.6)
        seen.append(rule.decide(1.0))
    assert [d.sync_every for d in seen] == [122, 122, 122]  # straight to H* = sqrt(1000 · 0.6 / 0.04) = 122.5
    assert [d.reason for d in seen] == ["grow", "hold", "hold"]
    assert seen[-1].exposed_fraction == pytest.approx(0.6 / (0.6 + 122 * 0.04))
    for _ in range(3):
        rule.observe(0.04, 60.0)  # a link 100x slower: H* far above, reached by doublings
        seen.append(rule.decide(1.0))
    assert [d.sync_every for d in seen[3:]] == [200, 200, 200]  # 244 > the bound
    overflow = _rule()
    overflow.observe(1e-300, 1e300)  # H* overflows to infinity: the first jump stops at the bound
    assert (overflow.decide(1.0).sync_every, overflow.decide(1.0).reason) == (200, "max")
    rule = _rule(high=1000)
    rule.observe(0.04, 0.6)
    assert rule.decide(1.0).sync_every == 122
    rule.observe(0.04, 2.4)  # the running mean: c = 1.5, H* = 194
    rule.observe(0.04, 6.0)  # c = 3.75, H* = 306: more than twice 122
    assert [rule.decide(1.0).sync_every, rule.decide(1.0).sync_every] == [244, 306]


def test_bounds_multiples_and_the_reasons_at_the_bounds():
    rule = _rule(low=4, high=40, start=12, multiple=4)
    for _ in range(4):
        rule.observe(0.04, 10.0)  # H* = 500: held at the top
        decision = rule.decide(1.0)
    assert decision.sync_every == 40 and decision.reason == "max"
    for _ in range(30):  # the running mean of c forgets the slow link by halves
        rule.observe(0.04, 0.0001)  # H* = 0.5: held at the bottom
        decision = rule.decide(1.0)
    assert decision.sync_every == 4 and decision.reason == "min"
    rule.observe(0.04, 0.5)
    assert rule.decide(1.0).sync_every % 4 == 0
    with pytest.raises(ValueError):
        AutoSyncEvery(low=5, high=40, start=12, drift_steps=1000.0, multiple=4)


def test_workers_that_went_apart_halve_h_whatever_the_costs_say():
    rule = _rule(start=80)
    rule.observe(0.04, 10.0)
    apart = rule.decide(1.0, spread=1.5)
    assert (apart.sync_every, apart.reason, apart.dispersion) == (40, "dispersion", 1.5)
    after = rule.decide(1.0, spread=0.3)  # H* = 500 beyond the bound: back up at the pace, not in one jump
    assert (after.sync_every, after.reason) == (80, "grow")


def test_a_decaying_lr_lengthens_the_rounds():
    early, late = _rule(start=100), _rule(start=100)
    for rule in (early, late):
        rule.observe(0.04, 0.4)
    assert early.decide(1.0).target == pytest.approx(100.0)
    assert late.decide(0.25).target == pytest.approx(200.0)


def _from_version_1(saved: dict) -> dict:
    """A rule's state as a train run's checkpoint of format version 1 held it, read back (migrated)."""
    from adloco.checkpoint import upgraded

    return upgraded({"format_version": 1, "cluster": {"sync_every": dict(saved)}}, "a test's state")["cluster"][
        "sync_every"
    ]


def test_the_state_round_trips_and_the_planner_follows_the_step_time():
    rule = _rule()
    rule.observe(0.05, 0.2)
    rule.decide(1.0)
    copy = _rule()
    copy.load_state_dict(rule.state_dict())
    assert copy.state_dict() == rule.state_dict() and copy.settled
    earlier = {k: v for k, v in rule.state_dict().items() if k != "settled"}  # a checkpoint from before the jump
    copy.load_state_dict(_from_version_1(earlier))
    assert copy.settled  # its exchange was measured: it had decided, and goes on at the 2x pace
    copy.load_state_dict(_from_version_1({**earlier, "exchange_seconds": math.nan}))
    assert not copy.settled
    plan = rule.planner(round_seconds=99.0)  # its own measurement wins over the given overhead
    assert plan(0.05) == pytest.approx(seconds_per_step(0.05, 0.2, rule.length_for(0.05, 0.2), 1000.0))
    assert rule.length_for(0.01, 0.2) > rule.length_for(0.1, 0.2)  # a faster step: longer rounds


def test_a_peers_time_between_rounds_is_not_taken_for_the_exchange():
    from adloco.sync import WorkerRound
    from adloco.workers.reports import exchange_time

    # rank 0 evaluated for 2 s before the round; rank 1 spent those 2 s waiting at the exchange
    waiting = [
        WorkerRound(overhead_seconds=0.1, between_seconds=2.0),
        WorkerRound(overhead_seconds=2.1, between_seconds=0.01),
    ]
    assert exchange_time(waiting) == pytest.approx(0.1)
    # never below what the rank that did not wait measured; nothing measured yet: NaN
    assert exchange_time([WorkerRound(overhead_seconds=0.5, between_seconds=3.0)]) == 0.5
    assert math.isnan(exchange_time([WorkerRound()]))
