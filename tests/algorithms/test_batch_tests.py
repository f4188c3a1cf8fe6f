"""Gradient statistics and batch-size tests: test vectors 5 and 6 (docs/design.md), estimators, controller."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adloco.algorithms.batch_tests import (
    NOISE_FLOOR,
    BatchSizeController,
    GradientStatistics,
    average_statistics,
    gram_matrix,
    inner_product_test_request,
    norm_test_request,
    pool,
    statistics_from_gram,
    statistics_from_norms,
    statistics_from_samples,
    summarize,
)

VECTOR5 = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)


def group_means(per_sample: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.stack([chunk.mean(dim=0) for chunk in torch.split(per_sample, sizes)])


def stats_close(a: GradientStatistics, b: GradientStatistics, rel: float = 1e-9, abs_: float = 1e-12) -> None:
    assert a.samples == b.samples
    for name in ("grad_norm_sq", "sample_variance", "ip_variance", "orth_variance"):
        x, y = getattr(a, name), getattr(b, name)
        assert x == pytest.approx(y, rel=rel, abs=abs_), name


# --- test vector 5 of docs/design.md ---------------------------------------------------------------------------


def test_vector5_statistics() -> None:
    stats = statistics_from_samples(VECTOR5)
    assert stats.samples == 4
    assert stats.grad_norm_sq == pytest.approx(1.0, abs=1e-15)
    assert stats.sample_variance == pytest.approx(4 / 3, abs=1e-15)
    assert stats.ip_variance == pytest.approx(2 / 3, abs=1e-15)
    assert stats.orth_variance == pytest.approx(2 / 3, abs=1e-15)
    # tr Cov = Var(a_iᵀg)/‖g‖² + Var_orth
    assert stats.sample_variance == pytest.approx(stats.ip_variance / stats.grad_norm_sq + stats.orth_variance)


def test_vector5_norm_test() -> None:
    stats = statistics_from_samples(VECTOR5)
    raw = norm_test_request(stats, workers=1, eta=0.5, unbiased=False)
    assert raw == pytest.approx(16 / 3, rel=1e-14)
    assert math.ceil(raw) == 6


def test_vector5_inner_product_test() -> None:
    stats = statistics_from_samples(VECTOR5)
    assert inner_product_test_request(stats, 1, theta=0.5, nu=1.0, unbiased=False) == pytest.approx(8 / 3)
    # With ϑ huge only the orthogonal part is left: b_orth = (2/3)/(ν²‖g‖²) with ν = 1.
    assert inner_product_test_request(stats, 1, theta=1e6, nu=1.0, unbiased=False) == pytest.approx(2 / 3)


def test_vector5_two_samples() -> None:
    stats = statistics_from_samples(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    assert stats.sample_variance == 2.0
    assert math.ceil(norm_test_request(stats, workers=1, eta=0.5, unbiased=False)) == 8


def test_vector5_gram_and_controller_use_unbiased_norm() -> None:
    gram = VECTOR5 @ VECTOR5.T
    stats = statistics_from_gram(gram, [1, 1, 1, 1])
    stats_close(stats, statistics_from_samples(VECTOR5), abs_=1e-14)
    unbiased = 1.0 - (4 / 3) / 4
    assert stats.unbiased_grad_norm_sq == pytest.approx(unbiased)
    decision = BatchSizeController("norm", eta=0.5, b_cap=100).decide(stats, workers=1, current_b=1)
    assert decision.raw_request == pytest.approx((4 / 3) / (0.25 * unbiased))
    # (4/3) / (0.25 · 2/3) = 8 exactly: the ceiling must not round float noise up to 9.
    assert decision.b_req == 8
    assert decision.grad_norm_sq == pytest.approx(unbiased)


def test_parameters_are_not_mixed_up() -> None:
    stats = statistics_from_samples(VECTOR5)
    base = inner_product_test_request(stats, 1, theta=0.5, nu=0.1, unbiased=False)
    # ν only scales the orthogonal part (2/3 / ν² = 66.7 dominates here), ϑ only the inner-product part.
    assert base == pytest.approx((2 / 3) / 0.01)
    assert inner_product_test_request(stats, 1, theta=0.05, nu=0.1, unbiased=False) == pytest.approx((2 / 3) / 0.0025)
    # Dividing by M.
    assert inner_product_test_request(stats, 4, theta=0.5, nu=0.1, unbiased=False) == pytest.approx(base / 4)


# --- test vector 6 of docs/design.md: exact pooling --------------------------------------------------------------


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_vector6_pooled_variance_equals_single_process(groups: int) -> None:
    gen = torch.Generator().manual_seed(groups)
    batch = torch.randn(64, 7, generator=gen, dtype=torch.float64) * 3.0 + 5.0
    pooled = pool([summarize(chunk) for chunk in batch.chunk(groups)])
    single = statistics_from_samples(batch)
    assert pooled.count == 64
    assert abs(pooled.m2 / (pooled.count - 1) - single.sample_variance) < 1e-12
    assert torch.allclose(pooled.mean, batch.mean(dim=0), rtol=0, atol=1e-12)
    assert pooled.variance == pytest.approx(single.sample_variance, abs=1e-12)


def test_pool_unequal_groups() -> None:
    gen = torch.Generator().manual_seed(3)
    batch = torch.randn(23, 5, generator=gen, dtype=torch.float64)
    pooled = pool([summarize(chunk) for chunk in torch.split(batch, [1, 4, 11, 7])])
    assert abs(pooled.variance - statistics_from_samples(batch).sample_variance) < 1e-12


# --- estimators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_gram_with_groups_of_one_equals_samples(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    per_sample = torch.randn(9, 6, generator=gen, dtype=torch.float64) + 0.5
    stats = statistics_from_gram(per_sample @ per_sample.T, [1] * 9)
    stats_close(stats, statistics_from_samples(per_sample))


@settings(max_examples=60, deadline=None, database=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=7),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    shift=st.floats(-3.0, 3.0),
)
def test_gram_and_norms_agree(sizes: list[int], dim: int, seed: int, shift: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    per_sample = torch.randn(sum(sizes), dim, generator=gen, dtype=torch.float64) + shift
    means = group_means(per_sample, sizes)
    from_gram = statistics_from_gram(means @ means.T, sizes)
    overall = per_sample.mean(dim=0)
    weighted = sum(n * float(m @ m) for n, m in zip(sizes, means, strict=True))
    from_norms = statistics_from_norms(weighted, float(overall @ overall), sizes)
    assert from_norms.samples == from_gram.samples == sum(sizes)
    assert from_norms.grad_norm_sq == pytest.approx(from_gram.grad_norm_sq, rel=1e-10, abs=1e-12)
    assert from_norms.sample_variance == pytest.approx(from_gram.sample_variance, rel=1e-8, abs=1e-10)
    assert from_norms.ip_variance is None and from_norms.orth_variance is None
    # Direct definition of the weighted between-group estimator.
    direct = sum(n * float((m - overall) @ (m - overall)) for n, m in zip(sizes, means, strict=True))
    assert from_gram.sample_variance == pytest.approx(direct / (len(sizes) - 1), rel=1e-8, abs=1e-10)
    # The decomposition tr Cov = Var_ip/‖g‖² + Var_orth also holds for grouped estimates.
    assert from_gram.sample_variance == pytest.approx(
        from_gram.ip_variance / from_gram.grad_norm_sq + from_gram.orth_variance, rel=1e-8, abs=1e-10
    )


def test_equal_groups_match_design_formula() -> None:
    gen = torch.Generator().manual_seed(11)
    k, n_g = 5, 3
    per_sample = torch.randn(k * n_g, 4, generator=gen, dtype=torch.float64) + 1.0
    means = group_means(per_sample, [n_g] * k)
    g = per_sample.mean(dim=0)
    design = n_g * (float((means**2).sum()) - k * float(g @ g)) / (k - 1)
    assert statistics_from_gram(means @ means.T, [n_g] * k).sample_variance == pytest.approx(design, rel=1e-10)


def test_gram_matrix_sums_over_parameters() -> None:
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)] for _ in range(3)]
    flat = torch.stack([torch.cat([p.reshape(-1) for p in g]) for g in grads]).to(torch.float64)
    gram = gram_matrix(grads)
    assert gram.dtype == torch.float64
    assert torch.allclose(gram, flat @ flat.T, rtol=1e-6, atol=1e-6)
    assert torch.equal(gram, gram.T)


def test_at_least_two_groups_required() -> None:
    with pytest.raises(ValueError, match="at least 2 groups"):
        statistics_from_gram(torch.ones(1, 1), [4])
    with pytest.raises(ValueError, match="at least 2 groups"):
        statistics_from_norms(1.0, 1.0, [4])
    with pytest.raises(ValueError):
        statistics_from_gram(torch.ones(2, 2), [1, 0])
    with pytest.raises(ValueError, match="2x2"):
        statistics_from_gram(torch.ones(3, 3), [1, 1])


def test_zero_mean_gradient_reports_all_variance_as_orthogonal() -> None:
    per_sample = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    for stats in (
        statistics_from_samples(per_sample),
        statistics_from_gram(per_sample @ per_sample.T, [1, 1]),
    ):
        assert stats.grad_norm_sq == 0.0
        assert stats.orth_variance == stats.sample_variance == 2.0


def test_microbatch_estimator_is_unbiased_on_linear_regression() -> None:
    """Grouped estimates averaged over many batches match the analytic per-sample variance.

    Model: loss_i = ½(x_iᵀw − y_i)², x ~ N(0, I_d), y = x_iᵀw* + ε, ε ~ N(0, s²). With r = w − w* the
    per-sample gradient is a_i = (x_iᵀr − ε_i) x_i, so ∇F = r and (Gaussian fourth moments)
    tr Cov(a_i) = (d + 1)‖r‖² + d·s². The mean over R independent batches has standard error
    std/√R (CLT); we allow 4.5 standard errors (false-failure probability ≈ 1e-5 for a fresh seed) and
    check the standard error is below 3% of the truth, so a wrong normalisation (k instead of k − 1,
    i.e. ≥ 20% off here, or forgetting the σ²/b correction, 75% off) cannot pass.
    """
    gen = torch.Generator().manual_seed(1234)
    d, s, b, reps = 4, 0.5, 8, 4000
    r = torch.tensor([0.5, -0.5, 0.5, 0.5], dtype=torch.float64)  # ‖r‖² = 1
    true_var = (d + 1) * float(r @ r) + d * s * s
    x = torch.randn(reps, b, d, generator=gen, dtype=torch.float64)
    eps = s * torch.randn(reps, b, generator=gen, dtype=torch.float64)
    per_sample = ((x @ r) - eps).unsqueeze(-1) * x  # (reps, b, d)

    for sizes in ([2, 2, 2, 2], [1, 2, 5]):
        means = torch.stack([chunk.mean(dim=1) for chunk in torch.split(per_sample, sizes, dim=1)], dim=1)
        grams = means @ means.transpose(1, 2)
        stats = [statistics_from_gram(grams[i], sizes) for i in range(reps)]
        for values, truth in (
            ([st_.sample_variance for st_ in stats], true_var),
            ([st_.unbiased_grad_norm_sq for st_ in stats], float(r @ r)),
        ):
            t = torch.tensor(values, dtype=torch.float64)
            se = float(t.std()) / math.sqrt(reps)
            assert se < 0.03 * truth
            assert abs(float(t.mean()) - truth) < 4.5 * se, (sizes, float(t.mean()), truth, se)
        biased = torch.tensor([st_.grad_norm_sq for st_ in stats]).mean()
        assert float(biased) == pytest.approx(float(r @ r) + true_var / b, rel=0.05)


# --- averaging across workers ---------------------------------------------------------------------------


def test_average_statistics() -> None:
    a = GradientStatistics(8, 2.0, 4.0, 1.0, 3.0)
    b = GradientStatistics(8, 1.0, 2.0, None, 1.0)
    c = GradientStatistics(8, 3.0, 6.0, 2.0, 2.0)
    avg = average_statistics([a, c])
    assert (avg.samples, avg.grad_norm_sq, avg.sample_variance, avg.ip_variance, avg.orth_variance) == (
        8,
        2.5,
        5.0,
        1.5,
        2.5,
    )
    assert avg.unbiased_grad_norm_sq == pytest.approx((a.unbiased_grad_norm_sq + c.unbiased_grad_norm_sq) / 2)
    mixed = average_statistics([a, b])
    assert mixed.ip_variance is None and mixed.orth_variance == 2.0
    # Workers with different micro-batch plans: the rounded mean count stands for them.
    assert average_statistics([a, GradientStatistics(5, 1.0, 1.0)]).samples == 6
    with pytest.raises(ValueError):
        average_statistics([])


def test_statistics_validation_and_to_dict() -> None:
    with pytest.raises(ValueError):
        GradientStatistics(4, float("nan"), 1.0)
    with pytest.raises(ValueError):
        GradientStatistics(4, 1.0, -1.0)
    with pytest.raises(ValueError):
        GradientStatistics(0, 1.0, 1.0)
    d = GradientStatistics(4, 2.0, 4.0).to_dict()
    assert d["unbiased_grad_norm_sq"] == 1.0 and d["ip_variance"] is None


# --- requests -----------------------------------------------------------------------------------------


def test_noise_dominated_requests_are_infinite() -> None:
    noisy = GradientStatistics(samples=4, grad_norm_sq=1.0, sample_variance=4.0)  # unbiased ‖∇F‖² = 0
    assert norm_test_request(noisy, 2, 0.8) == math.inf
    assert norm_test_request(noisy, 2, 0.8, unbiased=False) == pytest.approx(4.0 / (2 * 0.64))
    tiny = GradientStatistics(4, 1.0 + 0.5 * NOISE_FLOOR, 4.0, 1.0, 1.0)
    assert norm_test_request(tiny, 1, 0.8) == math.inf
    assert inner_product_test_request(tiny, 1, 0.8, 1.0) == math.inf
    quiet = GradientStatistics(4, 0.0, 0.0, 0.0, 0.0)
    assert norm_test_request(quiet, 1, 0.8) == 0.0
    assert inner_product_test_request(quiet, 1, 0.8, 1.0) == 0.0
    with pytest.raises(ValueError, match="ip_variance"):
        inner_product_test_request(GradientStatistics(4, 1.0, 1.0), 1, 0.8, 1.0)
    with pytest.raises(ValueError):
        norm_test_request(quiet, 0, 0.8)
    with pytest.raises(ValueError):
        norm_test_request(quiet, 1, 0.0)


finite = st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def gradient_statistics(draw: st.DrawFn) -> GradientStatistics:
    return GradientStatistics(
        samples=draw(st.integers(1, 4096)),
        grad_norm_sq=draw(finite),
        sample_variance=draw(finite),
        ip_variance=draw(finite),
        orth_variance=draw(finite),
    )


@settings(max_examples=200, deadline=None, database=None)
@given(
    stats=gradient_statistics(),
    workers=st.integers(1, 64),
    eta=st.floats(0.01, 10.0),
    nu=st.floats(0.01, 10.0),
    unbiased=st.booleans(),
)
def test_requests_never_negative_or_nan(
    stats: GradientStatistics, workers: int, eta: float, nu: float, unbiased: bool
) -> None:
    for raw in (
        norm_test_request(stats, workers, eta, unbiased=unbiased),
        inner_product_test_request(stats, workers, eta, nu, unbiased=unbiased),
    ):
        assert not math.isnan(raw)
        assert raw >= 0.0


# --- controller ---------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, database=None)
@given(
    history=st.lists(gradient_statistics(), min_size=1, max_size=12),
    test=st.sampled_from(["norm", "inner_product"]),
    ema=st.sampled_from([0.0, 0.5, 0.9]),
    start=st.integers(1, 64),
)
def test_monotone_controller_never_shrinks(
    history: list[GradientStatistics], test: str, ema: float, start: int
) -> None:
    controller = BatchSizeController(test, ema=ema, b_min=2, b_cap=256)  # type: ignore[arg-type]
    b = start
    for stats in history:
        decision = controller.decide(stats, workers=3, current_b=b)
        assert 2 <= decision.b_req <= 256
        assert decision.b_req >= min(b, 256)
        assert not math.isnan(decision.raw_request) and decision.raw_request >= 0
        if decision.noise_dominated:
            assert decision.b_req == 256
        b = decision.b_req


def test_allow_shrink_and_clamping() -> None:
    stats = GradientStatistics(samples=16, grad_norm_sq=2.0, sample_variance=16.0)  # unbiased ‖∇F‖² = 1
    raw = 16.0 / (2 * 0.25)
    assert raw == 32.0
    shrinking = BatchSizeController("norm", eta=0.5, b_cap=1000, allow_shrink=True)
    assert shrinking.decide(stats, 2, current_b=100).b_req == 32
    monotone = BatchSizeController("norm", eta=0.5, b_cap=1000)
    assert monotone.decide(stats, 2, current_b=100).b_req == 100
    assert monotone.decide(stats, 2, current_b=10).b_req == 32
    assert BatchSizeController("norm", eta=0.5, b_cap=20).decide(stats, 2, 10).b_req == 20
    assert BatchSizeController("norm", eta=0.5, b_min=40, b_cap=99).decide(stats, 2, 1).b_req == 40
    # current_b above the cap is pulled back to it even in monotone mode.
    assert BatchSizeController("norm", eta=0.5, b_cap=20).decide(stats, 2, 50).b_req == 20


def test_constant_test_keeps_b_but_reports_request() -> None:
    stats = GradientStatistics(samples=16, grad_norm_sq=2.0, sample_variance=16.0)
    decision = BatchSizeController("constant", eta=0.5, b_cap=1000).decide(stats, 2, current_b=7)
    assert decision.b_req == 7
    assert decision.raw_request == 32.0
    d = decision.to_dict()
    assert d["b_req"] == 7 and d["noise_dominated"] is False


def test_noise_dominated_decision_goes_to_cap() -> None:
    stats = GradientStatistics(samples=4, grad_norm_sq=1.0, sample_variance=8.0)
    decision = BatchSizeController("norm", b_cap=123).decide(stats, 1, current_b=5)
    assert decision.noise_dominated and decision.raw_request == math.inf and decision.b_req == 123
    assert decision.grad_norm_sq == pytest.approx(-1.0)


def test_inner_product_controller_reports_parts() -> None:
    stats = statistics_from_samples(VECTOR5)
    decision = BatchSizeController("inner_product", theta=0.5, nu=1.0, b_cap=100).decide(stats, 1, 1)
    g = stats.unbiased_grad_norm_sq
    assert decision.ip_request == pytest.approx((2 / 3) / (0.25 * g * g))
    assert decision.orth_request == pytest.approx((2 / 3) / g)
    assert decision.raw_request == max(decision.ip_request, decision.orth_request)
    with pytest.raises(ValueError, match="ip_variance"):
        BatchSizeController("inner_product", b_cap=10).decide(GradientStatistics(4, 1.0, 1.0), 1, 1)


def test_ema_smoothing() -> None:
    controller = BatchSizeController("norm", eta=1.0, ema=0.5, b_cap=10_000)
    first = GradientStatistics(samples=10, grad_norm_sq=2.0, sample_variance=10.0)  # unbiased 1.0
    second = GradientStatistics(samples=20, grad_norm_sq=4.0, sample_variance=40.0)  # unbiased 2.0
    d1 = controller.decide(first, 1, 1)
    assert (d1.sample_variance, d1.grad_norm_sq) == (10.0, 1.0)
    d2 = controller.decide(second, 1, 1)
    assert (d2.sample_variance, d2.grad_norm_sq) == (25.0, 1.5)
    assert d2.raw_request == pytest.approx(25.0 / 1.5)


def test_state_dict_resumes_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    history = [
        GradientStatistics(8, float(torch.rand(1, generator=gen)) + 0.5, float(torch.rand(1, generator=gen)) * 4)
        for _ in range(6)
    ]
    straight = BatchSizeController("norm", ema=0.7, b_cap=512)
    decisions = []
    b = 1
    for stats in history:
        decisions.append(straight.decide(stats, 2, b))
        b = decisions[-1].b_req

    first = BatchSizeController("norm", ema=0.7, b_cap=512)
    b = 1
    for stats in history[:3]:
        b = first.decide(stats, 2, b).b_req
    resumed = BatchSizeController("norm", ema=0.7, b_cap=512)
    # The state is plain python: it survives a JSON round trip unchanged.
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for stats, expected in zip(history[3:], decisions[3:], strict=True):
        got = resumed.decide(stats, 2, b)
        assert got == expected
        b = got.b_req
    with pytest.raises(ValueError):
        resumed.load_state_dict({"bogus": 1})


def test_controller_validation() -> None:
    with pytest.raises(ValueError):
        BatchSizeController("bogus", b_cap=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BatchSizeController(b_min=8, b_cap=4)
    with pytest.raises(ValueError):
        BatchSizeController(ema=1.0, b_cap=4)
    with pytest.raises(ValueError):
        BatchSizeController(eta=0.0, b_cap=4)
