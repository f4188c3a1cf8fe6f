"""``adloco estimate``: predict the rounds a run needs to reach a target loss from its gradient statistics.

The model and its assumptions are in ``docs/estimate.md``; the math is :mod:`adloco.algorithms.theory`.
This module reads a run directory, calibrates the model's constant on the first rounds, predicts the
remaining rounds and, when the run got there, compares with the round where it actually did.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adloco.algorithms.theory import (
    RoundsPrediction,
    calibrate_scale,
    fit_linear_in_loss,
    noise_scale,
    progress_per_round,
    rounds_to_target,
)
from adloco.config import ConfigError
from adloco.data import DataError
from adloco.metrics import read_metrics

__all__ = ["CALIBRATE_SHARE", "MIN_CALIBRATION", "RoundPoint", "estimate", "format_estimate", "load_rounds"]

# Share of the run's rounds used for calibration when --calibrate-rounds is not given.
CALIBRATE_SHARE = 0.2
# Fewest rounds that give a loss drop and a line fit at all.
MIN_CALIBRATION = 3
_NO_STATISTICS = (
    "has no batch-test statistics (‖∇F‖², σ²) in metrics.jsonl; train it with batch.test=norm "
    "(add batch.b_min=B batch.b_cap=B to keep the batch fixed at B) or method=adloco"
)


@dataclass(frozen=True)
class RoundPoint:
    """One round of the followed trainer: its training loss, the batch it ran with and the statistics measured
    at its first inner step (None when the test did not run that round)."""

    round: int
    steps: int
    tokens: int
    round_tokens: int
    loss: float
    workers: int
    batch: int
    trainers_batch: int  # Σ over all trainers of workers × b: samples per inner step in the whole run
    grad_norm_sq: float | None
    sample_variance: float | None

    def unit_progress(self) -> float:
        """Predicted loss drop of this round in units of κ (0 without statistics)."""
        if self.grad_norm_sq is None or self.sample_variance is None:
            return 0.0
        return progress_per_round(self.grad_norm_sq, self.sample_variance, self.workers * self.batch, self.steps)


def _as_int_keys(mapping: Any) -> dict[int, Any]:
    if not isinstance(mapping, dict):
        return {}
    return {int(k): v for k, v in mapping.items()}


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def load_rounds(run_dir: Path) -> tuple[Any, list[dict[str, Any]], int | None]:
    """The run's config, its "round" records in order and the final record's best trainer (None if unfinished)."""
    from adloco.training import resume_config

    config = resume_config(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise DataError(f"'{run_dir}' has no metrics.jsonl: the run has not completed a round yet")
    try:
        records = read_metrics(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"'{path}' is not valid JSON Lines ({error})") from None
    rounds = sorted((r for r in records if r.get("kind") == "round"), key=lambda r: r.get("round", -1))
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    best = final.get("best_trainer") if final else None
    return config, rounds, int(best) if isinstance(best, (int, str)) and str(best).isdigit() else None


def _follow(config: Any, rounds: list[dict[str, Any]], trainer: int) -> list[RoundPoint]:
    """The rounds in which ``trainer`` existed, with the batch it ran each round with."""
    points = []
    tokens_before = 0
    batch_before = {k: config.batch.size for k in range(config.trainers)}
    for record in rounds:
        batches = _as_int_keys(record.get("batch"))
        workers = _as_int_keys(record.get("workers"))
        losses = _as_int_keys(record.get("train_loss"))
        loss = _number(losses.get(trainer))
        if loss is not None and trainer in workers:
            test = _as_int_keys(record.get("batch_test")).get(trainer) or {}
            # "batch" is written after the round's test; the round itself ran with the previous record's value.
            ran_with = {k: batch_before.get(k, b) for k, b in batches.items()}
            points.append(
                RoundPoint(
                    round=int(record["round"]),
                    steps=int(record.get("steps") or config.sync_every),
                    tokens=int(record.get("tokens") or 0),
                    round_tokens=int(record.get("tokens") or 0) - tokens_before,
                    loss=loss,
                    workers=int(workers[trainer]),
                    batch=int(ran_with.get(trainer, config.batch.size)),
                    trainers_batch=sum(int(workers.get(k, 0)) * int(b) for k, b in ran_with.items()),
                    grad_norm_sq=_number(test.get("grad_norm_sq")),
                    sample_variance=_number(test.get("sample_variance")),
                )
            )
        batch_before.update({k: int(b) for k, b in batches.items()})
        tokens_before = int(record.get("tokens") or tokens_before)
    return points


def _measured(points: list[RoundPoint], target: float, syncs_per_round: int) -> dict[str, Any] | None:
    for point in points:
        if point.loss <= target:
            return {
                "round": point.round,
                "rounds": point.round + 1,
                "tokens": point.tokens,
                "synchronisations": (point.round + 1) * syncs_per_round,
            }
    return None


def _syncs_per_round(config: Any, steps: int) -> int:
    # DDP all-reduces gradients at every inner step; every other method synchronises once per round.
    return steps if config.method == "ddp" else 1


def estimate(
    run_dir: Path, target: float, calibrate_rounds: int | None = None, trainer: int | None = None
) -> dict[str, Any]:
    """Calibrate on the first rounds of ``run_dir``, predict the rounds to ``target`` and compare with the run.

    Raises ConfigError for a bad target or a run without batch-test statistics and DataError when the run
    has too few rounds to calibrate on.
    """
    if not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ConfigError(f"--target must be a finite loss, got {target!r}")
    if calibrate_rounds is not None and calibrate_rounds < MIN_CALIBRATION:
        raise ConfigError(f"--calibrate-rounds must be >= {MIN_CALIBRATION}, got {calibrate_rounds}")
    run_dir = Path(run_dir)
    config, rounds, best = load_rounds(run_dir)
    if trainer is None:
        trainer = best if best is not None else 0
    points = _follow(config, rounds, trainer)
    if not points:
        raise DataError(f"'{run_dir}' has no completed rounds of trainer {trainer} in metrics.jsonl")
    if not any(p.grad_norm_sq is not None and p.sample_variance is not None for p in points):
        raise ConfigError(f"run '{run_dir}' {_NO_STATISTICS}")
    count = (
        calibrate_rounds if calibrate_rounds is not None else max(MIN_CALIBRATION, round(CALIBRATE_SHARE * len(points)))
    )
    if count > len(points):
        raise DataError(
            f"nothing to calibrate on: '{run_dir}' has {len(points)} rounds of trainer {trainer}, "
            f"--calibrate-rounds asks for {count}"
        )
    calibration = points[:count]
    # The first rounds fall from the initialisation loss at a pace no local model of the statistics follows
    # (warm-up, the unigram phase), so κ and the statistics come from the later half of the window.
    window = calibration[count // 2 :]
    measured_points = [p for p in window if p.grad_norm_sq is not None and p.sample_variance is not None]
    if len(measured_points) < 2:
        raise DataError(
            f"nothing to calibrate on: only {len(measured_points)} of rounds {window[0].round}-{window[-1].round} "
            "have batch-test statistics; give more --calibrate-rounds"
        )
    # Round r's statistics describe the step from round r to round r + 1, so the last round of the window
    # only provides the end loss.
    loss_drop = window[0].loss - window[-1].loss
    try:
        scale = calibrate_scale(loss_drop, [p.unit_progress() for p in window[:-1]])
    except ValueError as error:
        raise DataError(
            f"nothing to calibrate on in rounds {window[0].round}-{window[-1].round} of '{run_dir}': {error}"
        ) from None
    # Single-step ‖∇F‖² estimates are noisy (often of either sign late in a run): carry their window mean
    # forward rather than a fitted trend, which the noise would dominate.
    losses = [p.loss for p in measured_points]
    grad_model = fit_linear_in_loss(losses, [p.grad_norm_sq for p in measured_points], slope=False)  # type: ignore[misc]
    variance_model = fit_linear_in_loss(losses, [p.sample_variance for p in measured_points], slope=False)  # type: ignore[misc]
    last = calibration[-1]
    norm_test = config.batch.test == "norm" and config.batch.b_cap > config.batch.b_min
    prediction = rounds_to_target(
        last.loss,
        target,
        scale=scale,
        steps=config.sync_every,
        workers=last.workers,
        batch=last.batch,
        grad_norm_sq=grad_model,
        sample_variance=variance_model,
        eta=config.batch.eta if norm_test else None,
        batch_cap=config.batch.b_cap if norm_test else None,
    )
    syncs = _syncs_per_round(config, config.sync_every)
    measured = _measured(points, target, syncs)
    if measured is not None and measured["round"] <= last.round:
        # Reached inside the calibration window: there is nothing left to predict.
        prediction = RoundsPrediction(rounds=None, losses=(), batches=(), reason="reached during calibration")
    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "method": config.method,
        "trainer": trainer,
        "target": target,
        "rounds_in_run": len(points),
        "calibration": {
            "rounds": count,
            "first_round": calibration[0].round,
            "last_round": last.round,
            "loss_start": calibration[0].loss,
            "loss_end": last.loss,
            "fit_first_round": window[0].round,
            "scale": scale,
            "grad_norm_sq": grad_model.intercept,
            "sample_variance": variance_model.intercept,
            "noise_scale": noise_scale(grad_model.intercept, variance_model.intercept),
            "loss_floor": _finite_or_none(grad_model.zero_at),
        },
        "prediction": _prediction_dict(prediction, last, config, syncs),
        "measured": measured,
    }
    result["relative_error"] = _relative_error(result["prediction"], measured)
    return result


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _prediction_dict(prediction: RoundsPrediction, last: RoundPoint, config: Any, syncs: int) -> dict[str, Any]:
    if prediction.reason == "reached during calibration":
        return {"reachable": True, "during_calibration": True}
    if prediction.rounds is None:
        return {"reachable": False, "reason": prediction.reason}
    # Samples per inner step of the whole run scale with the followed trainer's predicted batch; the tokens
    # per sample come from the last measured round (the context, whatever the model resolved it to).
    per_sample_step = last.round_tokens / (last.steps * last.trainers_batch)
    others = last.trainers_batch - last.workers * last.batch
    tokens = last.tokens
    for b in prediction.batches:
        tokens += (others + last.workers * b) * config.sync_every * per_sample_step
    tokens = round(tokens)
    round_index = last.round + prediction.rounds
    return {
        "reachable": True,
        "more_rounds": prediction.rounds,
        "round": round_index,
        "rounds": round_index + 1,
        "tokens": tokens,
        "synchronisations": (round_index + 1) * syncs,
        "final_batch": prediction.batches[-1] if prediction.batches else last.batch,
    }


def _relative_error(prediction: dict[str, Any], measured: dict[str, Any] | None) -> float | None:
    if measured is None or "rounds" not in prediction:
        return None
    return (prediction["rounds"] - measured["rounds"]) / measured["rounds"]


def format_estimate(result: dict[str, Any]) -> str:
    """Human-readable lines for the command's default output."""
    cal = result["calibration"]
    lines = [
        f"run {result['run_dir']} ({result['method']}, trainer {result['trainer']}, {result['rounds_in_run']} rounds)",
        f"calibrated on rounds {cal['first_round']}-{cal['last_round']} (fit on {cal['fit_first_round']}-"
        f"{cal['last_round']}): loss {cal['loss_start']:.4f} -> {cal['loss_end']:.4f}, kappa {cal['scale']:.4g}, "
        f"|grad F|^2 {cal['grad_norm_sq']:.4g}, sigma^2 {cal['sample_variance']:.4g}, "
        f"noise scale {cal['noise_scale']:.4g} samples"
        + (f", loss floor {cal['loss_floor']:.4f}" if cal["loss_floor"] is not None else ""),
    ]
    pred = result["prediction"]
    target = result["target"]
    if pred.get("during_calibration"):
        lines.append(f"predicted: nothing to predict, the run reached loss {target:g} during the calibration rounds")
    elif pred["reachable"]:
        lines.append(
            f"predicted: loss {target:g} at round {pred['round']} ({pred['rounds']} rounds, "
            f"{pred['tokens']:,} tokens, {pred['synchronisations']} synchronisations)"
        )
    else:
        lines.append(f"predicted: loss {target:g} is not reached ({pred['reason']})")
    measured = result["measured"]
    if measured is None:
        lines.append(f"measured: the run did not reach loss {target:g}")
    else:
        lines.append(
            f"measured: loss {target:g} at round {measured['round']} ({measured['rounds']} rounds, "
            f"{measured['tokens']:,} tokens, {measured['synchronisations']} synchronisations)"
        )
    if result["relative_error"] is not None:
        lines.append(f"relative error in rounds: {result['relative_error']:+.1%}")
    return "\n".join(lines)
