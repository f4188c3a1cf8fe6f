"""Step and round costs for the time-aware controller: start-up timing and what the round reports teach."""

import math
import time

import pytest

from adloco.algorithms.controller import StepCost
from adloco.batch.pace import CostModel, time_steps, timed_batches
from adloco.workers.reports import WorkerRound


def test_the_start_up_timing_covers_b_to_8b_within_the_top():
    assert timed_batches(3, 64) == [3, 6, 12, 24]
    assert timed_batches(3, 10) == [3, 6, 10]
    assert timed_batches(5, 5) == [5]


def test_timed_steps_fit_the_line_of_their_median_times():
    calls = {}

    def step_at(b):  # a step of known cost, 20 ms + 10 ms per sample, spent on the clock the timing reads
        calls[b] = calls.get(b, 0) + 1
        end = time.perf_counter() + 0.020 + 0.010 * b
        while time.perf_counter() < end:
            pass

    cost = time_steps(step_at, [1, 4, 8], repeats=3)
    assert calls == {1: 4, 4: 4, 8: 4}  # one warm-up and three timed steps each
    assert cost.per_sample == pytest.approx(0.010, rel=0.2) and cost.overhead == pytest.approx(0.020, abs=0.01)


def test_the_cost_model_follows_the_measured_steps_and_overheads():
    model = CostModel({0: StepCost(0.01, 0.001), 1: StepCost(0.01, 0.001)}, True, None)
    reports = {0: WorkerRound(step_seconds=0.026, overhead_seconds=0.3), 1: WorkerRound(step_seconds=0.013)}
    model.learn(reports, {0: 8, 1: 3})  # predicted 0.018 and 0.013 s: worker 0 runs 1.44x slower
    assert model.factor[0] == pytest.approx(1 + 0.5 * (0.026 / 0.018 - 1)) and model.factor[1] == pytest.approx(1)
    assert model.round_seconds == pytest.approx(0.15)
    envelope = model.trainer_cost([0, 1])
    assert (envelope.overhead, envelope.per_sample) == pytest.approx((0.01 * model.factor[0], 0.001 * model.factor[0]))
    model.learn({0: WorkerRound()}, {0: 8})  # no measurement (NaN): nothing changes
    assert model.round_seconds == pytest.approx(0.15)
    restored = CostModel({0: StepCost(1, 1), 1: StepCost(1, 1)}, True, None)
    restored.load_state_dict(model.state_dict())
    assert restored.trainer_cost([0, 1]) == envelope and restored.round_seconds == model.round_seconds


def test_pinned_costs_ignore_the_clock():
    model = CostModel({0: StepCost(0.01, 0.001)}, False, 0.05)
    model.learn({0: WorkerRound(step_seconds=9.0, overhead_seconds=9.0)}, {0: 4})
    assert model.trainer_cost([0]) == StepCost(0.01, 0.001) and model.round_seconds == 0.05
    assert math.isnan(WorkerRound().step_seconds)
