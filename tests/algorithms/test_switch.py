"""Switch mode micro-batch plans (test vector 10 of docs/design.md) and the b_max search."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches, search_max_batch


def test_vector10() -> None:
    single = plan_micro_batches(5, b_max=8, switch_factor=2)
    assert (single.sizes, single.mode, single.micro, single.accum, single.samples) == (
        (5,),
        "single",
        5,
        1,
        5,
    )
    capped = plan_micro_batches(12, b_max=8, switch_factor=2)
    assert (capped.sizes, capped.mode, capped.micro, capped.accum, capped.samples) == (
        (8,),
        "capped",
        8,
        1,
        8,
    )
    accum = plan_micro_batches(17, b_max=8, switch_factor=2)
    assert (accum.sizes, accum.mode, accum.micro, accum.accum, accum.samples) == (
        (6, 6, 5),
        "accumulate",
        6,
        3,
        17,
    )


def test_boundaries() -> None:
    assert plan_micro_batches(8, 8).mode == "single"
    assert plan_micro_batches(16, 8).mode == "capped"  # b_req = n·b_max still capped
    assert plan_micro_batches(17, 8).mode == "accumulate"
    assert plan_micro_batches(9, 8, switch_factor=1).sizes == (5, 4)
    assert plan_micro_batches(12, 8, switch_factor=1.5).mode == "capped"
    assert plan_micro_batches(13, 8, switch_factor=1.5).mode == "accumulate"


@pytest.mark.parametrize(
    ("b_req", "b_max", "factor"),
    [
        (0, 8, 2.0),
        (5, 0, 2.0),
        (5, 8, 0.5),
        (5, 8, math.inf),
        (5, 8, math.nan),
        (2.5, 8, 2.0),
        (True, 8, 2.0),
    ],
)
def test_invalid_inputs(b_req: int, b_max: int, factor: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        plan_micro_batches(b_req, b_max, factor)


@settings(max_examples=300, deadline=None, database=None)
@given(b_req=st.integers(1, 5000), b_max=st.integers(1, 300), factor=st.floats(1.0, 4.0))
def test_plan_properties(b_req: int, b_max: int, factor: float) -> None:
    plan = plan_micro_batches(b_req, b_max, factor)
    assert isinstance(plan, MicroBatchPlan)
    assert plan.micro <= b_max
    assert max(plan.sizes) - min(plan.sizes) <= 1
    assert list(plan.sizes) == sorted(plan.sizes, reverse=True)
    if plan.mode == "capped":
        assert plan.sizes == (b_max,) and b_max < b_req <= factor * b_max
    else:
        assert plan.samples == b_req
        assert plan.accum == (1 if b_req <= b_max else math.ceil(b_req / b_max))
        assert (plan.mode == "single") == (b_req <= b_max)


def counting(threshold: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= threshold

    return calls, fits


@settings(max_examples=300, deadline=None, database=None)
@given(threshold=st.integers(0, 5000), upper=st.integers(1, 4096), lower=st.integers(1, 64))
def test_search_max_batch(threshold: int, upper: int, lower: int) -> None:
    upper = max(upper, lower)
    calls, fits = counting(threshold)
    found = search_max_batch(fits, upper=upper, lower=lower)  # type: ignore[arg-type]
    expected = 0 if threshold < lower else min(threshold, upper)
    assert found == expected
    assert len(calls) == len(set(calls)), "a batch size was probed twice"
    assert all(lower <= b <= upper for b in calls)
    # doubling (≤ log2(upper/lower) + 1 probes) then bisection of a gap ≤ upper (≤ log2(upper) probes)
    assert len(calls) <= math.ceil(math.log2(upper / lower)) + math.ceil(math.log2(upper)) + 2


def test_search_max_batch_validation() -> None:
    with pytest.raises(ValueError):
        search_max_batch(lambda b: True, upper=4, lower=0)
    with pytest.raises(ValueError):
        search_max_batch(lambda b: True, upper=2, lower=4)
    assert search_max_batch(lambda b: True, upper=7) == 7
    assert search_max_batch(lambda b: False, upper=7) == 0
