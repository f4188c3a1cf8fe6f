"""Rounds-to-target theory: per-round loss progress from measured gradient statistics (no I/O).

The derivation is in ``docs/estimate.md``. In short, with ‖∇F‖² = G, per-sample variance σ² and the
simple noise scale B_noise = σ²/G (McCandlish et al. 2018), one inner step at global batch B makes loss
progress proportional to G / (1 + B_noise/B); a round of H inner steps on M workers at per-worker batch b
is modelled as κ · H · G / (1 + B_noise/(M·b)) with one constant κ that absorbs the step size, the curvature
and the cost of local drift. κ is calibrated on the first rounds of a run; the statistics are then carried
forward as linear functions of the loss, which lets the model predict how many more rounds reach a target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LinearInLoss",
    "RoundsPrediction",
    "calibrate_scale",
    "fit_linear_in_loss",
    "noise_scale",
    "norm_test_batch",
    "progress_per_round",
    "rounds_to_target",
    "step_efficiency",
]


def _check_finite(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    _check_finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def noise_scale(grad_norm_sq: float, sample_variance: float) -> float:
    """Simple noise scale B_noise = σ² / ‖∇F‖² (samples).

    0 without noise; ``math.inf`` when the ‖∇F‖² estimate is ≤ 0 (noise swamps the signal), never a
    division by zero.
    """
    _check_finite("grad_norm_sq", grad_norm_sq)
    _check_finite("sample_variance", sample_variance)
    if sample_variance < 0:
        raise ValueError(f"sample_variance must be >= 0, got {sample_variance!r}")
    if sample_variance == 0:
        return 0.0
    if grad_norm_sq <= 0:
        return math.inf
    return sample_variance / grad_norm_sq


def step_efficiency(batch: float, noise: float) -> float:
    """Share 1 / (1 + B_noise/B) of the noise-free progress that one step at batch B achieves."""
    _check_positive("batch", batch)
    if math.isinf(noise) and noise > 0:
        return 0.0
    _check_finite("noise", noise)
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    return batch / (batch + noise)


def progress_per_round(
    grad_norm_sq: float, sample_variance: float, batch: float, steps: float, scale: float = 1.0
) -> float:
    """Predicted loss decrease of one round: κ · H · G / (1 + B_noise/B).

    ``batch`` is the global batch B = M·b of one inner step, ``steps`` the H inner steps of the round and
    ``scale`` the calibrated κ (1 gives the progress in units of κ). A ‖∇F‖² estimate ≤ 0 gives 0.
    """
    _check_positive("steps", steps)
    _check_finite("scale", scale)
    if scale < 0:
        raise ValueError(f"scale must be >= 0, got {scale!r}")
    if grad_norm_sq <= 0:
        _check_finite("grad_norm_sq", grad_norm_sq)
        return 0.0
    return scale * steps * grad_norm_sq * step_efficiency(batch, noise_scale(grad_norm_sq, sample_variance))


def calibrate_scale(loss_drop: float, unit_progress: Sequence[float]) -> float:
    """κ that makes the summed per-round progress (in units of κ) equal the observed loss drop.

    Raises ValueError when there is nothing to calibrate on (no progress predicted) or the loss did not
    fall, since then no positive κ describes the run.
    """
    _check_finite("loss_drop", loss_drop)
    total = 0.0
    for value in unit_progress:
        _check_finite("unit_progress", value)
        total += value
    if total <= 0:
        raise ValueError("no predicted progress in the calibration rounds (‖∇F‖² estimates all ≤ 0)")
    if loss_drop <= 0:
        raise ValueError(f"the loss did not fall during the calibration rounds (change {-loss_drop:+.4g})")
    return loss_drop / total


@dataclass(frozen=True)
class LinearInLoss:
    """A statistic modelled as ``intercept + slope · L``, floored at 0 (a norm or variance is never negative)."""

    intercept: float
    slope: float = 0.0

    def __call__(self, loss: float) -> float:
        return max(self.intercept + self.slope * loss, 0.0)

    @property
    def zero_at(self) -> float:
        """The loss at which the statistic reaches 0 (``-inf`` when it never does)."""
        if self.slope <= 0:
            return -math.inf if self.intercept > 0 or self.slope < 0 else math.inf
        return -self.intercept / self.slope


def fit_linear_in_loss(losses: Sequence[float], values: Sequence[float], *, slope: bool = True) -> LinearInLoss:
    """Least-squares line through (L, value) pairs; ``slope=False`` (or a single point) gives the mean.

    A fitted slope < 0 (the statistic grows as the loss falls) is kept: it is what the data say.
    """
    if len(losses) != len(values) or not losses:
        raise ValueError(f"need as many losses as values and at least one, got {len(losses)} and {len(values)}")
    n = len(losses)
    mean_l = sum(losses) / n
    mean_v = sum(values) / n
    spread = sum((x - mean_l) ** 2 for x in losses)
    if not slope or n < 2 or spread == 0:
        return LinearInLoss(intercept=mean_v, slope=0.0)
    fitted = sum((x - mean_l) * (y - mean_v) for x, y in zip(losses, values, strict=True)) / spread
    return LinearInLoss(intercept=mean_v - fitted * mean_l, slope=fitted)


def norm_test_batch(
    grad_norm_sq: float, sample_variance: float, workers: int, eta: float, current: int, cap: int
) -> int:
    """Next per-worker batch under the monotone norm test: ⌈σ² / (M·η²·G)⌉ clamped to [current, cap]."""
    _check_positive("eta", eta)
    if grad_norm_sq <= 0:
        return cap
    raw = sample_variance / grad_norm_sq / (eta * eta) / workers
    if raw >= cap:
        return cap
    return min(max(math.ceil(raw - 1e-9 * raw), current), cap)


@dataclass(frozen=True)
class RoundsPrediction:
    """Rounds (and the inner steps and per-worker batches along the way) until the loss reaches a target.

    ``rounds`` is 0 when the start is already at or below the target and ``None`` when the model never gets
    there (``reason`` says why); ``losses`` is the predicted loss after each round.
    """

    rounds: int | None
    losses: tuple[float, ...]
    batches: tuple[int, ...]
    reason: str = ""

    @property
    def reachable(self) -> bool:
        return self.rounds is not None


def rounds_to_target(
    start_loss: float,
    target: float,
    *,
    scale: float,
    steps: int,
    workers: int,
    batch: int,
    grad_norm_sq: LinearInLoss,
    sample_variance: LinearInLoss,
    eta: float | None = None,
    batch_cap: int | None = None,
    max_rounds: int = 100_000,
) -> RoundsPrediction:
    """Iterate L ← L − κ·H·G(L)/(1 + σ²(L)/(M·b·G(L))) from ``start_loss`` until L ≤ ``target``.

    With ``eta`` and ``batch_cap`` the per-worker batch follows the monotone norm test each round (as a run
    with ``batch.test=norm`` does); otherwise it stays ``batch``. The target is unreachable under the model
    when it lies at or below the loss where G(L) vanishes (progress stops there) or when ``max_rounds`` pass.
    """
    _check_finite("start_loss", start_loss)
    _check_finite("target", target)
    _check_positive("scale", scale)
    for name, value in (("steps", steps), ("workers", workers), ("batch", batch), ("max_rounds", max_rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if (eta is None) != (batch_cap is None):
        raise ValueError("give both eta and batch_cap for a norm-test batch, or neither")
    if start_loss <= target:
        return RoundsPrediction(rounds=0, losses=(), batches=())
    floor = grad_norm_sq.zero_at
    if floor >= target:
        return RoundsPrediction(
            rounds=None,
            losses=(),
            batches=(),
            reason=f"the fitted ‖∇F‖² vanishes at loss {floor:.4g}, above the target: progress stops before it",
        )
    loss = start_loss
    b = batch
    losses: list[float] = []
    batches: list[int] = []
    for _ in range(max_rounds):
        g = grad_norm_sq(loss)
        variance = sample_variance(loss)
        batches.append(b)
        drop = progress_per_round(g, variance, workers * b, steps, scale)
        if drop <= 0:
            return RoundsPrediction(None, tuple(losses), tuple(batches), f"no progress predicted at loss {loss:.4g}")
        loss -= drop
        losses.append(loss)
        if loss <= target:
            return RoundsPrediction(len(losses), tuple(losses), tuple(batches))
        if eta is not None and batch_cap is not None:
            b = norm_test_batch(g, variance, workers, eta, b, batch_cap)
    return RoundsPrediction(
        None, tuple(losses), tuple(batches), f"not reached within {max_rounds} rounds (loss {loss:.4g})"
    )
