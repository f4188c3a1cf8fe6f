"""Shares of a trainer's batch for workers of unequal speed, and the sample weights of their pseudo-gradients."""

import random

import pytest

from adloco.algorithms.controller import StepCost
from adloco.algorithms.shares import balanced_cost, balanced_split, sample_weights


def test_a_worker_twice_as_fast_reads_twice_the_samples():
    assert balanced_split(6, [StepCost(0.0, 0.01), StepCost(0.0, 0.02)]) == [4, 2]
    assert balanced_split(8, [StepCost(0.0, 0.01), StepCost(0.0, 0.03)]) == [6, 2]


def test_equal_costs_split_equally():
    for n in (1, 2, 3, 4, 7):
        assert balanced_split(5 * n, [StepCost(0.003, 0.01)] * n) == [5] * n


def test_a_fixed_overhead_is_balanced_too():
    # t = 0.1 + 0.01·b against t = 0.01·b: the second catches up by 10 samples.
    assert balanced_split(20, [StepCost(0.1, 0.01), StepCost(0.0, 0.01)]) == [5, 15]


def test_a_worker_too_slow_for_even_one_sample_still_reads_one():
    assert balanced_split(6, [StepCost(5.0, 0.01), StepCost(0.0, 0.01), StepCost(0.0, 0.01)]) == [1, 3, 2]


def test_shares_are_whole_at_least_one_sum_to_the_total_and_even_out_the_step_times():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        costs = [StepCost(rng.uniform(0, 0.05), rng.uniform(1e-4, 0.05)) for _ in range(n)]
        total = rng.randint(n, 200)
        shares = balanced_split(total, costs)
        assert sum(shares) == total and min(shares) >= 1
        unfloored = [c.at(b) for c, b in zip(costs, shares, strict=True) if b > 1]
        if len(unfloored) > 1:  # rounding leaves at most one sample's time between any two
            assert max(unfloored) - min(unfloored) <= 2 * max(c.per_sample for c in costs) + 1e-12


def test_the_balanced_cost_is_the_common_step_time():
    costs = [StepCost(0.02, 0.01), StepCost(0.0, 0.03), StepCost(0.01, 0.02)]
    line = balanced_cost(costs)
    b = 40  # per worker: 120 samples over three
    shares = balanced_split(3 * b, costs)
    times = [c.at(s) for c, s in zip(costs, shares, strict=True)]
    assert min(times) - 0.03 <= line.at(b) <= max(times) + 0.03
    assert balanced_cost([StepCost(0.004, 0.01)] * 4) == StepCost(pytest.approx(0.004), pytest.approx(0.01))


def test_sample_weights_are_exactly_one_for_equal_shares_and_mean_one_otherwise():
    assert sample_weights([3, 3, 3]) == [1.0, 1.0, 1.0]
    assert sample_weights([6, 2]) == [1.5, 0.5]
    weights = sample_weights([5, 2, 7, 1])
    assert sum(weights) == pytest.approx(4.0) and weights[2] / weights[3] == pytest.approx(7.0)


@pytest.mark.parametrize(("total", "n"), [(1, 2), (0, 1), (3, 0)])
def test_too_few_samples_for_the_workers_is_an_error(total, n):
    with pytest.raises(ValueError, match="cannot split"):
        balanced_split(total, [StepCost(0.0, 0.01)] * n)
