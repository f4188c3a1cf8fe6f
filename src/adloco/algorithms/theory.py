"""Rounds-to-target theory: per-round loss progress from measured gradient statistics (no I/O).

The derivation is in ``docs/estimate.md``. In short, with ‖∇F‖² = G, per-sample variance σ² and the
simple noise scale B_noise = σ²/G (McCandlish et al. 2018), one inner step at global batch B and learning
rate ε makes loss progress proportional to ε·G / (1 + B_noise/B). G is modelled as G_ref·exp(β(L − L_ref))
with β read off the measured statistics, σ² as constant, and one constant κ, fitted to the loss curve of
the first rounds of a run, absorbs the curvature, the optimizer and the cost of local drift. Iterating the
model from there predicts how many more rounds reach a target.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from adloco.algorithms.schedules import inner_lr

__all__ = [
    "LossModel",
    "RoundsPrediction",
    "Schedule",
    "calibrate_scale",
    "fit_scale",
    "log_slope",
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


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


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
    """Predicted loss decrease of one round: κ · h · G / (1 + B_noise/B).

    ``batch`` is the global batch B = M·b of one inner step, ``steps`` the round's h = Σ ε_t/ε_peak over its
    inner steps (H at a constant learning rate) and ``scale`` the calibrated κ (1 gives the progress in units
    of κ). A ‖∇F‖² estimate ≤ 0 gives 0.
    """
    _check_finite("steps", steps)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")
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
class Schedule:
    """The run's inner learning rate relative to its peak: warm-up over steps, then cosine decay over tokens."""

    peak: float
    minimum: float
    warmup_steps: int
    total_tokens: int
    steps: int  # H, inner steps per round

    def round_weight(self, first_step: int, tokens_before: float, tokens_per_step: float) -> float:
        """h = Σ ε_t/ε_peak over the H inner steps of a round starting at global step ``first_step``."""
        if first_step >= self.warmup_steps and tokens_before >= self.total_tokens:
            return self.steps * self.minimum / self.peak  # past the budget the schedule stays at its minimum
        total = 0.0
        for step in range(self.steps):
            fraction = (tokens_before + step * tokens_per_step) / self.total_tokens
            total += inner_lr(first_step + step, fraction, self.peak, self.minimum, self.warmup_steps)
        return total / self.peak


def log_slope(loss_a: float, grad_a: float, loss_b: float, grad_b: float) -> float:
    """β of G(L) = G_b·exp(β(L − L_b)) through two (loss, ‖∇F‖²) points; 0 unless G fell as the loss fell.

    0 (a ‖∇F‖² that does not depend on the loss) also when either estimate is ≤ 0 or the losses are equal.
    """
    for name, value in (("loss_a", loss_a), ("grad_a", grad_a), ("loss_b", loss_b), ("grad_b", grad_b)):
        _check_finite(name, value)
    if grad_a <= 0 or grad_b <= 0 or loss_a == loss_b:
        return 0.0
    slope = math.log(grad_a / grad_b) / (loss_a - loss_b)
    return max(slope, 0.0)


@dataclass(frozen=True)
class LossModel:
    """Per-round progress κ·h·G(L)/(1 + σ²/(B·G(L))) with G(L) = G_ref·exp(β(L − L_ref)) and σ² constant.

    β = 0 means G does not depend on the loss (every round at the same batch and learning rate drops the
    loss by the same amount).
    """

    scale: float
    slope: float
    ref_loss: float
    ref_grad_norm_sq: float
    sample_variance: float

    def grad_norm_sq(self, loss: float) -> float:
        """‖∇F‖² at ``loss``."""
        return self.ref_grad_norm_sq * math.exp(min(self.slope * (loss - self.ref_loss), 700.0))

    def drop(self, loss: float, batch: float, weight: float) -> float:
        """Predicted loss decrease of a round at global batch ``batch`` with lr-weighted steps ``weight``."""
        return progress_per_round(self.grad_norm_sq(loss), self.sample_variance, batch, weight, self.scale)


def _trajectory(model: LossModel, start: float, batches: Sequence[float], weights: Sequence[float]) -> list[float]:
    losses = [start]
    for batch, weight in zip(batches, weights, strict=True):
        losses.append(losses[-1] - model.drop(losses[-1], batch, weight))
    return losses


def fit_scale(
    losses: Sequence[float],
    batches: Sequence[float],
    weights: Sequence[float],
    *,
    slope: float,
    grad_norm_sq: float,
    sample_variance: float,
) -> LossModel:
    """The κ whose predicted trajectory from ``losses[0]`` best matches ``losses`` (least squares in the loss).

    ``batches[i]`` and ``weights[i]`` are the global batch and lr-weighted steps of the round from
    ``losses[i]`` to ``losses[i + 1]``; ``grad_norm_sq`` and ``sample_variance`` are measured at the median of
    ``losses`` and ``slope`` is β. Raises ValueError when the losses did not fall or G is not positive.
    """
    if len(losses) < 2 or len(batches) != len(losses) - 1 or len(weights) != len(losses) - 1:
        raise ValueError(
            f"need at least 2 losses and one batch and weight per transition, got {len(losses)}, "
            f"{len(batches)} and {len(weights)}"
        )
    for name, values in (("losses", losses), ("batches", batches), ("weights", weights)):
        for value in values:
            _check_finite(name, value)
    _check_positive("grad_norm_sq", grad_norm_sq)
    _check_finite("sample_variance", sample_variance)
    _check_finite("slope", slope)
    ref = (slope, statistics.median(losses), grad_norm_sq, sample_variance)
    unit = LossModel(1.0, *ref)
    # The κ that matches the total drop with G at its reference value brackets the search.
    guess = calibrate_scale(
        losses[0] - losses[-1], [unit.drop(ref[1], b, w) for b, w in zip(batches, weights, strict=True)]
    )

    def misfit(log_scale: float) -> float:
        path = _trajectory(LossModel(math.exp(log_scale), *ref), losses[0], batches, weights)
        return sum((a - b) ** 2 for a, b in zip(path, losses, strict=True))

    # Golden-section search of log κ within a factor 10⁴ of the guess (the misfit is unimodal in κ).
    lo, hi = math.log(guess) - 4 * math.log(10), math.log(guess) + 4 * math.log(10)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = misfit(a), misfit(b)
    for _ in range(60):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = misfit(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = misfit(b)
    return LossModel(math.exp(a if fa <= fb else b), *ref)


@dataclass(frozen=True)
class RoundsPrediction:
    """Rounds (and the per-worker batches and tokens along the way) until the loss reaches a target.

    ``rounds`` is 0 when the start is already at or below the target and ``None`` when the model never gets
    there (``reason`` says why); ``losses`` is the predicted loss after each round and ``tokens`` the
    run's token count after each round.
    """

    rounds: int | None
    losses: tuple[float, ...]
    batches: tuple[int, ...]
    tokens: tuple[float, ...] = ()
    reason: str = ""

    @property
    def reachable(self) -> bool:
        return self.rounds is not None


def _check_path_inputs(
    start_loss: float,
    target: float,
    sample_tokens: float,
    workers: int,
    batch: int,
    max_rounds: int,
    eta: float | None,
    batch_cap: int | None,
) -> None:
    _check_finite("start_loss", start_loss)
    _check_finite("target", target)
    _check_positive("sample_tokens", sample_tokens)
    for name, value in (("workers", workers), ("batch", batch), ("max_rounds", max_rounds)):
        _check_count(name, value)
    if (eta is None) != (batch_cap is None):
        raise ValueError("give both eta and batch_cap for a norm-test batch, or neither")


def rounds_to_target(
    model: LossModel,
    start_loss: float,
    target: float,
    *,
    workers: int,
    batch: int,
    schedule: Schedule,
    step: int,
    tokens: float,
    sample_tokens: float,
    other_samples: int = 0,
    eta: float | None = None,
    batch_cap: int | None = None,
    max_rounds: int = 100_000,
) -> RoundsPrediction:
    """Iterate L ← L − κ·h·G(L)/(1 + σ²/(M·b·G(L))) from ``start_loss`` until L ≤ ``target``.

    The run stands at global inner step ``step`` after ``tokens`` tokens; one sample is ``sample_tokens``
    tokens and ``other_samples`` are the samples per inner step of the other trainers (held fixed). With
    ``eta`` and ``batch_cap`` the per-worker batch follows the monotone norm test each round (as a run with
    ``batch.test=norm`` does); otherwise it stays ``batch``. The target is unreachable when ``max_rounds``
    pass without reaching it or when a round predicts no progress.
    """
    _check_path_inputs(start_loss, target, sample_tokens, workers, batch, max_rounds, eta, batch_cap)
    if start_loss <= target:
        return RoundsPrediction(rounds=0, losses=(), batches=())
    loss = start_loss
    b = batch
    losses: list[float] = []
    batches: list[int] = []
    token_path: list[float] = []
    for _ in range(max_rounds):
        samples = other_samples + workers * b
        weight = schedule.round_weight(step, tokens, samples * sample_tokens)
        batches.append(b)
        drop = model.drop(loss, workers * b, weight)
        if drop <= 0:
            return RoundsPrediction(
                None, tuple(losses), tuple(batches), tuple(token_path), f"no progress predicted at loss {loss:.4g}"
            )
        loss -= drop
        step += schedule.steps
        tokens += schedule.steps * samples * sample_tokens
        losses.append(loss)
        token_path.append(tokens)
        if loss <= target:
            return RoundsPrediction(len(losses), tuple(losses), tuple(batches), tuple(token_path))
        if eta is not None and batch_cap is not None:
            b = norm_test_batch(model.grad_norm_sq(loss), model.sample_variance, workers, eta, b, batch_cap)
    return RoundsPrediction(
        None,
        tuple(losses),
        tuple(batches),
        tuple(token_path),
        f"not reached within {max_rounds} rounds (loss {loss:.4g})",
    )
