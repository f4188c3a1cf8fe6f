"""Trainer merges (test vector 9 of docs/design.md), merge group selection and merge weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adloco.algorithms.merge import merge_weights, merged_batch_size, select_merge_group, weighted_average


def test_vector9() -> None:
    gen = torch.Generator().manual_seed(9)
    theta1 = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    ]
    theta2 = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    ]
    mom1 = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    ]
    mom2 = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    ]
    b = [1, 3]
    weights = merge_weights("b_req", b, worker_counts=[2, 2])
    assert weights == [0.25, 0.75]
    for merged, first, second in (
        (weighted_average([theta1, theta2], weights), theta1, theta2),
        (weighted_average([mom1, mom2], weights), mom1, mom2),
    ):
        for m, x, y in zip(merged, first, second, strict=True):
            assert m.dtype == torch.float64
            assert torch.equal(m, 0.25 * x + 0.75 * y)
    assert merged_batch_size(b) == 3
    # Unnormalised weights give the same result.
    assert all(
        torch.equal(a, c)
        for a, c in zip(
            weighted_average([theta1, theta2], [1, 3]),
            weighted_average([theta1, theta2], weights),
            strict=True,
        )
    )


def test_float32_accumulates_in_float64() -> None:
    x = torch.tensor([1.0, 1e8], dtype=torch.float32)
    y = torch.tensor([2.0, -1e8], dtype=torch.float32)
    merged = weighted_average([[x], [y], [x]], [1.0, 1.0, 1.0])[0]
    assert merged.dtype == torch.float32
    expected = ((x.double() + y.double() + x.double()) / 3).float()
    assert torch.equal(merged, expected)


def test_none_momentum_counts_as_zero() -> None:
    buf = torch.tensor([4.0, -8.0])
    merged = weighted_average([[None, buf], [None, None]], [1.0, 3.0])
    assert merged[0] is None
    assert torch.equal(merged[1], torch.tensor([1.0, -2.0]))


def test_weighted_average_validation() -> None:
    a = [torch.zeros(2)]
    with pytest.raises(ValueError):
        weighted_average([a, a], [1.0])
    with pytest.raises(ValueError):
        weighted_average([a, a], [0.0, 0.0])
    with pytest.raises(ValueError):
        weighted_average([a, a], [-1.0, 2.0])
    with pytest.raises(ValueError, match="shape"):
        weighted_average([a, [torch.zeros(3)]], [1.0, 1.0])
    with pytest.raises(ValueError, match="numbers of tensors"):
        weighted_average([a, a + a], [1.0, 1.0])


def test_select_merge_group() -> None:
    assert select_merge_group({0: 8, 1: 2, 2: 4, 3: 2}) == [1, 3]
    assert select_merge_group({5: 3, 1: 3, 2: 3}) == [1, 2]
    assert select_merge_group({0: 8, 1: 2, 2: 4, 3: 2}, group_size=3) == [1, 2, 3]
    assert select_merge_group({7: 1, 4: 9}, group_size=3) == [4, 7]
    with pytest.raises(ValueError):
        select_merge_group({0: 1})
    with pytest.raises(ValueError):
        select_merge_group({0: 1, 1: 2}, group_size=1)


@settings(max_examples=200, deadline=None, database=None)
@given(
    b_req=st.dictionaries(st.integers(0, 50), st.integers(1, 20), min_size=2, max_size=10),
    group_size=st.integers(2, 5),
)
def test_select_merge_group_properties(b_req: dict[int, int], group_size: int) -> None:
    group = select_merge_group(b_req, group_size)
    assert group == sorted(set(group))
    assert len(group) == min(group_size, len(b_req))
    rest = [tid for tid in b_req if tid not in group]
    # Every chosen trainer ranks before every trainer left out.
    assert all((b_req[g], g) < (b_req[r], r) for g in group for r in rest)


def test_merge_weights_policies() -> None:
    assert merge_weights("b_req", [2, 6], [1, 3]) == [0.25, 0.75]
    # Reference: demand = |workers| · b.
    assert merge_weights("pairwise_reference", [2, 6], [3, 1]) == [0.5, 0.5]
    assert merge_weights("pairwise_reference", [2, 6], [1, 1]) == merge_weights("b_req", [2, 6], [1, 1])
    # A trainer with no workers left counts its bare b.
    assert merge_weights("pairwise_reference", [4, 4], [0, 3]) == [0.25, 0.75]
    w = merge_weights("b_req", [1, 2, 5], [1, 1, 1])
    assert sum(w) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        merge_weights("bogus", [1, 2], [1, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        merge_weights("b_req", [1, 2], [1])
    with pytest.raises(ValueError):
        merge_weights("b_req", [0, 2], [1, 1])
    with pytest.raises(ValueError):
        merged_batch_size([])
