"""Gradient-noise statistics and the adaptive batch-size tests (norm test, augmented inner-product test).

Conventions used throughout:

* a *per-sample gradient* is a_i; a batch of n samples has mean gradient ḡ = (1/n) Σ a_i.
* the *sample variance* σ² is the per-sample trace of the covariance, tr Cov(a_i), estimated with the
  1/(n − 1) normalisation.
* grouped estimators see only k group-MEAN gradients ḡ_j (group j holds n_j samples) and use the
  weighted between-group form Σ_j n_j ‖ḡ_j − ḡ‖² / (k − 1), which is unbiased for σ² for any group sizes
  (it reduces to the per-sample formula when every group holds one sample).

Only scalars ever leave a worker: a trainer averages its workers' :class:`GradientStatistics` with
:func:`average_statistics` and feeds the result to a :class:`BatchSizeController`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

__all__ = [
    "NOISE_FLOOR",
    "BatchDecision",
    "BatchSizeController",
    "GradientStatistics",
    "MomentSummary",
    "average_statistics",
    "gram_matrix",
    "inner_product_test_request",
    "norm_test_request",
    "pool",
    "statistics_from_gram",
    "statistics_from_norms",
    "statistics_from_samples",
    "summarize",
]

# A ‖∇F‖² estimate at or below NOISE_FLOOR·σ² counts as noise-dominated. Any request it would produce
# exceeds 1e8/(M·η²) samples, far above any realistic b_cap, so the flag only changes what is logged,
# never the decision, while it keeps divisions away from zero and negative denominators.
NOISE_FLOOR = 1e-8

# Ceiling tolerance: a request that is an integer up to float rounding (8.000000000000002) must not
# round up to the next integer.
_CEIL_RTOL = 1e-9

TestName = Literal["norm", "inner_product", "constant"]


@dataclass(frozen=True)
class GradientStatistics:
    """Scalar summary of the gradient noise at one point θ.

    ``grad_norm_sq`` is ‖ḡ‖² of the batch-mean gradient (biased upwards by σ²/samples);
    ``sample_variance`` is the per-sample tr Cov estimate; ``ip_variance`` and ``orth_variance`` are the
    per-sample variances of a_iᵀḡ and of the part of a_i orthogonal to ḡ (None when not measured).
    """

    samples: int
    grad_norm_sq: float
    sample_variance: float
    ip_variance: float | None = None
    orth_variance: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be a positive int, got {self.samples!r}")
        for name in ("grad_norm_sq", "sample_variance", "ip_variance", "orth_variance"):
            value = getattr(self, name)
            if value is None and name in ("ip_variance", "orth_variance"):
                continue
            # NaN or inf statistics mean the gradients themselves are broken: fail loudly here rather
            # than let a NaN batch size reach the data loader.
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")

    @property
    def unbiased_grad_norm_sq(self) -> float:
        """Unbiased estimate of ‖∇F‖²: ‖ḡ‖² − σ²/samples (may be negative when noise dominates)."""
        return self.grad_norm_sq - self.sample_variance / self.samples

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for logging, including the unbiased ‖∇F‖² estimate."""
        out = asdict(self)
        out["unbiased_grad_norm_sq"] = self.unbiased_grad_norm_sq
        return out


def _validate_group_sizes(group_sizes: Sequence[int]) -> list[int]:
    sizes = [int(n) for n in group_sizes]
    if len(sizes) < 2:
        raise ValueError(f"need at least 2 groups to estimate a variance, got {len(sizes)}")
    if any(n < 1 for n in sizes):
        raise ValueError(f"group sizes must be >= 1, got {sizes}")
    return sizes


def gram_matrix(groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Gram matrix (float64, k×k) of k gradients, each given as a list of per-parameter tensors.

    Dot products run in the tensors' own dtype (float32 for training) per parameter and are summed in
    float64, so a model with many parameter tensors does not accumulate float32 rounding across them.
    """
    k = len(groups)
    if k == 0:
        raise ValueError("gram_matrix needs at least one gradient")
    gram = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(i, k):
            total = 0.0
            for a, b in zip(groups[i], groups[j], strict=True):
                total += float(torch.dot(a.reshape(-1), b.reshape(-1)))
            gram[i, j] = total
            gram[j, i] = total
    return gram


def statistics_from_gram(gram: torch.Tensor, group_sizes: Sequence[int]) -> GradientStatistics:
    """Statistics from the k×k Gram matrix of k group-MEAN gradients with ``group_sizes`` samples each.

    σ² = Σ_j n_j ‖ḡ_j − ḡ‖² / (k − 1), Var_ip = Σ_j n_j (ḡ_jᵀḡ − ‖ḡ‖²)² / (k − 1) and
    Var_orth = Σ_j n_j ‖ḡ_j − (ḡ_jᵀḡ/‖ḡ‖²) ḡ‖² / (k − 1), where ḡ is the sample-weighted mean.
    With every group of size 1 these are the exact per-sample formulas. When ḡ = 0 the projection is
    undefined and all of the variance is reported as orthogonal.
    """
    sizes = _validate_group_sizes(group_sizes)
    k = len(sizes)
    if gram.shape != (k, k):
        raise ValueError(f"gram must be {k}x{k} for {k} groups, got shape {tuple(gram.shape)}")
    g = gram.detach().to(torch.float64)
    w = torch.tensor(sizes, dtype=torch.float64)
    n = float(w.sum())
    # x_j = ḡ_jᵀḡ, and ‖ḡ‖² = Σ_j (n_j/n) x_j.
    x = (g @ w) / n
    mean_sq = float((w * x).sum()) / n
    diag = torch.diagonal(g)
    # ‖ḡ_j − ḡ‖² expanded through the Gram matrix; rounding can push tiny values below zero.
    dev_sq = (diag - 2.0 * x + mean_sq).clamp_min(0.0)
    sample_variance = float((w * dev_sq).sum()) / (k - 1)
    ip_variance = float((w * (x - mean_sq) ** 2).sum()) / (k - 1)
    if mean_sq > 0.0:
        orth_sq = (diag - x * x / mean_sq).clamp_min(0.0)
        orth_variance = float((w * orth_sq).sum()) / (k - 1)
    else:
        orth_variance = sample_variance
    return GradientStatistics(
        samples=int(n),
        grad_norm_sq=max(mean_sq, 0.0),
        sample_variance=sample_variance,
        ip_variance=ip_variance,
        orth_variance=orth_variance,
    )


def statistics_from_norms(
    sum_weighted_sq: float, mean_norm_sq: float, group_sizes: Sequence[int]
) -> GradientStatistics:
    """Norm-test statistics from Σ_j n_j ‖ḡ_j‖² and ‖ḡ‖² alone (no Gram matrix, no inner products).

    σ² = (Σ_j n_j ‖ḡ_j‖² − n‖ḡ‖²) / (k − 1); for equal groups of n_g this is the pooled
    n_g (Σ_j ‖ḡ_j‖² − k‖ḡ‖²)/(k − 1). Agrees with :func:`statistics_from_gram` up to rounding.
    """
    sizes = _validate_group_sizes(group_sizes)
    k = len(sizes)
    n = sum(sizes)
    sum_weighted_sq = float(sum_weighted_sq)
    mean_norm_sq = float(mean_norm_sq)
    # The difference is a sum of squares in exact arithmetic; clamp the rounding residue.
    sample_variance = max(sum_weighted_sq - n * mean_norm_sq, 0.0) / (k - 1)
    return GradientStatistics(samples=n, grad_norm_sq=mean_norm_sq, sample_variance=sample_variance)


def statistics_from_samples(per_sample: torch.Tensor) -> GradientStatistics:
    """Exact per-sample statistics from an n×d matrix of per-sample gradients (computed in float64)."""
    if per_sample.dim() != 2 or per_sample.shape[0] < 2:
        raise ValueError(f"per_sample must be n x d with n >= 2, got shape {tuple(per_sample.shape)}")
    a = per_sample.detach().to(torch.float64)
    n = a.shape[0]
    mean = a.mean(dim=0)
    mean_sq = float(mean @ mean)
    sample_variance = float(((a - mean) ** 2).sum()) / (n - 1)
    ip = a @ mean
    ip_variance = float(((ip - mean_sq) ** 2).sum()) / (n - 1)
    if mean_sq > 0.0:
        orth = a - torch.outer(ip / mean_sq, mean)
        orth_variance = float((orth**2).sum()) / (n - 1)
    else:
        orth_variance = sample_variance
    return GradientStatistics(
        samples=n,
        grad_norm_sq=mean_sq,
        sample_variance=sample_variance,
        ip_variance=ip_variance,
        orth_variance=orth_variance,
    )


def average_statistics(stats: Sequence[GradientStatistics]) -> GradientStatistics:
    """Combine the M workers' statistics of one trainer: the mean of each scalar.

    ``samples`` stays the per-worker count, so ``unbiased_grad_norm_sq`` of the result is the mean of the
    workers' unbiased estimates; workers whose devices gave them different micro-batch plans report different
    counts, and then the rounded mean stands for them. ip/orth variances are kept only when every worker
    measured them.
    """
    if not stats:
        raise ValueError("average_statistics needs at least one GradientStatistics")
    m = len(stats)

    def mean_of(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return math.fsum(present) / m if len(present) == m else None

    return GradientStatistics(
        samples=round(math.fsum(s.samples for s in stats) / m),
        grad_norm_sq=math.fsum(s.grad_norm_sq for s in stats) / m,
        sample_variance=math.fsum(s.sample_variance for s in stats) / m,
        ip_variance=mean_of([s.ip_variance for s in stats]),
        orth_variance=mean_of([s.orth_variance for s in stats]),
    )


@dataclass
class MomentSummary:
    """Count, mean vector and m2 = Σ_i ‖a_i − mean‖² of a set of per-sample vectors."""

    count: int
    mean: torch.Tensor
    m2: float

    @property
    def variance(self) -> float:
        """Per-sample tr Cov estimate m2 / (count − 1)."""
        if self.count < 2:
            raise ValueError("variance needs count >= 2")
        return self.m2 / (self.count - 1)


def summarize(per_sample: torch.Tensor) -> MomentSummary:
    """Exact moment summary of an n×d matrix of per-sample vectors (float64 for float64 input)."""
    if per_sample.dim() != 2 or per_sample.shape[0] < 1:
        raise ValueError(f"per_sample must be n x d with n >= 1, got shape {tuple(per_sample.shape)}")
    a = per_sample.detach()
    if not a.is_floating_point() or a.dtype in (torch.float16, torch.bfloat16):
        a = a.to(torch.float32)
    mean = a.mean(dim=0)
    return MomentSummary(count=a.shape[0], mean=mean, m2=float(((a - mean) ** 2).sum()))


def pool(summaries: Sequence[MomentSummary]) -> MomentSummary:
    """Merge moment summaries exactly (Chan, Golub & LeVeque's parallel update)."""
    if not summaries:
        raise ValueError("pool needs at least one MomentSummary")
    count = summaries[0].count
    mean = summaries[0].mean.clone()
    m2 = summaries[0].m2
    for s in summaries[1:]:
        if s.count == 0:
            continue
        total = count + s.count
        delta = s.mean.to(mean.dtype) - mean
        # The between-set term restores the spread that the two separate means hide.
        m2 = m2 + s.m2 + float(delta @ delta) * count * s.count / total
        mean = mean + delta * (s.count / total)
        count = total
    return MomentSummary(count=count, mean=mean, m2=m2)


def _validate_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _validate_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")


def _noise_dominated(grad_norm_sq: float, sample_variance: float) -> bool:
    return grad_norm_sq <= 0.0 or grad_norm_sq <= NOISE_FLOOR * sample_variance


def _norm_request(sample_variance: float, grad_norm_sq: float, workers: int, eta: float) -> float:
    if sample_variance <= 0.0:
        return 0.0  # no measured noise: any batch passes
    if _noise_dominated(grad_norm_sq, sample_variance):
        return math.inf
    # Chained divisions: a product of small denominators could underflow to exactly zero.
    return sample_variance / grad_norm_sq / (eta * eta) / workers


def _inner_product_requests(
    sample_variance: float,
    ip_variance: float,
    orth_variance: float,
    grad_norm_sq: float,
    workers: int,
    theta: float,
    nu: float,
) -> tuple[float, float]:
    if ip_variance <= 0.0 and orth_variance <= 0.0:
        return 0.0, 0.0
    if _noise_dominated(grad_norm_sq, sample_variance):
        return math.inf, math.inf
    b_ip = ip_variance / grad_norm_sq / grad_norm_sq / (theta * theta)
    b_orth = orth_variance / grad_norm_sq / (nu * nu)
    return b_ip / workers, b_orth / workers


def norm_test_request(stats: GradientStatistics, workers: int, eta: float, *, unbiased: bool = True) -> float:
    """Raw per-worker norm-test request σ² / (M · η² · ‖∇F‖²).

    ‖∇F‖² is the unbiased estimate ‖ḡ‖² − σ²/samples by default (what the trainer uses);
    ``unbiased=False`` takes ‖ḡ‖² as given, as in the textbook per-sample formulation (test vector 5 of docs/design.md).
    Returns 0 when σ² = 0 and ``math.inf`` when the ‖∇F‖² estimate is ≤ 0 or below NOISE_FLOOR·σ²;
    never negative, never NaN.
    """
    _validate_workers(workers)
    _validate_positive("eta", eta)
    grad_norm_sq = stats.unbiased_grad_norm_sq if unbiased else stats.grad_norm_sq
    return _norm_request(stats.sample_variance, grad_norm_sq, workers, eta)


def inner_product_test_request(
    stats: GradientStatistics, workers: int, theta: float, nu: float, *, unbiased: bool = True
) -> float:
    """Raw per-worker augmented inner-product request max(b_ip, b_orth) / M.

    b_ip = Var_ip / (ϑ² ‖∇F‖⁴) bounds the noise along the gradient, b_orth = Var_orth / (ν² ‖∇F‖²) the
    noise orthogonal to it; ϑ belongs to the first, ν to the second, and both variances are sums over
    coordinates (not means). ``unbiased`` and the inf/0 conventions are as in :func:`norm_test_request`.
    """
    _validate_workers(workers)
    _validate_positive("theta", theta)
    _validate_positive("nu", nu)
    if stats.ip_variance is None or stats.orth_variance is None:
        raise ValueError("the inner-product test needs ip_variance and orth_variance (use a Gram estimator)")
    grad_norm_sq = stats.unbiased_grad_norm_sq if unbiased else stats.grad_norm_sq
    b_ip, b_orth = _inner_product_requests(
        stats.sample_variance, stats.ip_variance, stats.orth_variance, grad_norm_sq, workers, theta, nu
    )
    return max(b_ip, b_orth)


def _ceil_request(raw: float) -> int:
    return math.ceil(raw - _CEIL_RTOL * raw)


@dataclass(frozen=True)
class BatchDecision:
    """Outcome of one batch test: the per-worker batch size to use next and what led to it."""

    b_req: int
    raw_request: float
    noise_dominated: bool
    sample_variance: float
    grad_norm_sq: float
    ip_request: float | None = None
    orth_request: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for logging (an infinite request is kept as ``float('inf')``)."""
        return asdict(self)


class BatchSizeController:
    """Turns a trainer's averaged gradient statistics into the next per-worker batch size.

    Defaults: η = 0.8 (the AdLoCo paper's); ϑ = 0.8 so that the along-gradient part of the augmented test is as strict
    as the norm test; ν = 1.0 tolerates orthogonal noise up to the gradient's own size. Since
    tr Cov = Var_ip/‖g‖² + Var_orth, with ϑ = ν = η the augmented test asks for between half of and all of
    the norm test's batch (exactly so when both use the same ‖g‖²). ``ema`` in [0, 1) smooths σ², ‖∇F‖²,
    Var_ip and Var_orth across rounds (0 = off). The "constant" test keeps b but still reports the
    norm-test request. Both tests use the unbiased ‖∇F‖² estimate. By default b never decreases.
    """

    def __init__(
        self,
        test: TestName = "norm",
        *,
        eta: float = 0.8,
        theta: float = 0.8,
        nu: float = 1.0,
        ema: float = 0.0,
        b_min: int = 1,
        b_cap: int,
        allow_shrink: bool = False,
    ) -> None:
        if test not in ("norm", "inner_product", "constant"):
            raise ValueError(f"test must be 'norm', 'inner_product' or 'constant', got {test!r}")
        _validate_positive("eta", eta)
        _validate_positive("theta", theta)
        _validate_positive("nu", nu)
        if not (isinstance(ema, (int, float)) and 0.0 <= ema < 1.0):
            raise ValueError(f"ema must be in [0, 1), got {ema!r}")
        if isinstance(b_min, bool) or not isinstance(b_min, int) or b_min < 1:
            raise ValueError(f"b_min must be an int >= 1, got {b_min!r}")
        if isinstance(b_cap, bool) or not isinstance(b_cap, int) or b_cap < b_min:
            raise ValueError(f"b_cap must be an int >= b_min ({b_min}), got {b_cap!r}")
        self.test: TestName = test
        self.eta = float(eta)
        self.theta = float(theta)
        self.nu = float(nu)
        self.ema = float(ema)
        self.b_min = b_min
        self.b_cap = b_cap
        self.allow_shrink = bool(allow_shrink)
        self._smoothed: dict[str, float | None] = {}
        self.rounds = 0

    def _smooth(self, name: str, value: float | None) -> float | None:
        previous = self._smoothed.get(name)
        if value is None or previous is None or self.ema == 0.0:
            smoothed = value
        else:
            smoothed = self.ema * previous + (1.0 - self.ema) * value
        self._smoothed[name] = smoothed
        return smoothed

    def decide(self, stats: GradientStatistics, workers: int, current_b: int) -> BatchDecision:
        """Run the test on ``stats`` (averaged over the trainer's ``workers``) and pick the next b."""
        _validate_workers(workers)
        if isinstance(current_b, bool) or not isinstance(current_b, int) or current_b < 1:
            raise ValueError(f"current_b must be an int >= 1, got {current_b!r}")
        # The unbiased ‖∇F‖² is smoothed directly: b changes between rounds, so smoothing ‖ḡ‖² and σ²
        # separately and correcting with the latest b would mix batch sizes.
        variance = self._smooth("sample_variance", stats.sample_variance)
        grad_norm_sq = self._smooth("grad_norm_sq", stats.unbiased_grad_norm_sq)
        ip_variance = self._smooth("ip_variance", stats.ip_variance)
        orth_variance = self._smooth("orth_variance", stats.orth_variance)
        assert variance is not None and grad_norm_sq is not None
        self.rounds += 1

        ip_request: float | None = None
        orth_request: float | None = None
        if self.test == "inner_product":
            if ip_variance is None or orth_variance is None:
                raise ValueError("the inner-product test needs ip_variance and orth_variance")
            ip_request, orth_request = _inner_product_requests(
                variance, ip_variance, orth_variance, grad_norm_sq, workers, self.theta, self.nu
            )
            raw = max(ip_request, orth_request)
        else:
            raw = _norm_request(variance, grad_norm_sq, workers, self.eta)
        noise_dominated = math.isinf(raw)

        if self.test == "constant":
            b = current_b
        else:
            requested = self.b_cap if noise_dominated else _ceil_request(raw)
            b = min(max(requested, self.b_min), self.b_cap)
            if not self.allow_shrink:
                # Monotone, but b_cap stays a hard ceiling even if current_b was set above it.
                b = min(max(b, current_b), self.b_cap)
        return BatchDecision(
            b_req=b,
            raw_request=raw,
            noise_dominated=noise_dominated,
            sample_variance=variance,
            grad_norm_sq=grad_norm_sq,
            ip_request=ip_request,
            orth_request=orth_request,
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain python values that restore the controller exactly (EMA state and round count)."""
        return {"rounds": self.rounds, "smoothed": dict(self._smoothed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if set(state) != {"rounds", "smoothed"}:
            raise ValueError(f"unexpected BatchSizeController state keys: {sorted(state)}")
        self.rounds = int(state["rounds"])
        self._smoothed = {k: (None if v is None else float(v)) for k, v in state["smoothed"].items()}


class GroupedGradient:
    """The mean gradient of a step whose samples came in groups, and the step's statistics from the groups'
    mean gradients: fed one group at a time, so only the Gram test keeps every group's gradient."""

    def __init__(self, sizes: Sequence[int], numel: int, gram: bool, device: torch.device) -> None:
        self.sizes, self.batch, self.gram = list(sizes), sum(sizes), gram
        self.total = torch.zeros(numel, dtype=torch.float32, device=device)
        self.weighted_sq = 0.0
        self.group_means: list[torch.Tensor] = []

    def add(self, group_mean: torch.Tensor, size: int) -> None:
        """One group's mean gradient (flat) over its ``size`` samples."""
        self.weighted_sq += size * float(group_mean.double().square().sum())
        self.total.add_(group_mean, alpha=size / self.batch)
        if self.gram:
            self.group_means.append(group_mean)

    def statistics(self, sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GradientStatistics:
        """The step's statistics; ``sum_over_shards`` adds up the sums of a sharded gradient's shards (each rank
        holds some rows of every group's gradient, and norms and inner products are sums over rows)."""
        add_up = sum_over_shards or (lambda sums: sums)
        if self.gram:
            stacked = torch.stack(self.group_means).double()
            return statistics_from_gram(add_up(stacked @ stacked.T), self.sizes)
        sums = add_up(torch.tensor([self.weighted_sq, float(self.total.double().square().sum())], dtype=torch.float64))
        return statistics_from_norms(float(sums[0]), float(sums[1]), self.sizes)
