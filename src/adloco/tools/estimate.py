"""``adloco estimate``: predict the rounds a run needs to reach a target loss from its gradient statistics.

The model and its assumptions are in ``docs/estimate.md``; the math is :mod:`adloco.algorithms.theory`.
This module reads a run directory, fits the model to the loss curve of the first rounds, predicts the
remaining rounds and, when the run got there, compares with the round where it actually did.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adloco.algorithms.theory import (
    LossModel,
    RoundsPrediction,
    Schedule,
    fit_scale,
    log_slope,
    rounds_to_target,
)
from adloco.config import BatchConfig, ConfigError, TrainConfig, resume_config
from adloco.config.methods import METHODS
from adloco.data import DataError
from adloco.metrics.writer import read_metrics

__all__ = [
    "CALIBRATE_SHARE",
    "HORIZON",
    "MIN_CALIBRATION",
    "RoundPoint",
    "estimate",
    "format_estimate",
    "load_rounds",
    "unreachable_message",
]

# Share of the run's rounds used for calibration when --calibrate-rounds is not given.
CALIBRATE_SHARE = 0.2
# Fewest rounds that leave a fit window of two rounds (the later half of the calibration rounds).
MIN_CALIBRATION = 3
# Predictions stop at this many times the run's own rounds: further out the extrapolation means nothing.
HORIZON = 100
_NO_STATISTICS = (
    "has no batch-test statistics (‖∇F‖², σ²) in metrics.jsonl; train it with batch.test=norm "
    "(add batch.b_min=B batch.b_cap=B to keep the batch fixed at B) or method=adloco"
)


@dataclass(frozen=True)
class RoundPoint:
    """One round of the followed trainer: its mean training loss, what it ran with and the statistics measured
    at its first inner step (None when the test did not run that round)."""

    round: int
    first_step: int  # global inner step at the start of the round
    steps: int
    tokens: int  # run total after the round
    tokens_before: int
    loss: float
    workers: int
    batch: int  # per-worker samples of one inner step in this round
    batch_after: int  # b the batch test set for the next round
    workers_after: int  # workers in the next round (after this round's merge)
    others_after: int  # samples per inner step of the other trainers in the next round
    samples: int  # samples per inner step of the whole run (every trainer)
    grad_norm_sq: float | None
    sample_variance: float | None
    merged: bool = False  # the trainer took part in a merge at the end of this round

    @property
    def measured(self) -> bool:
        return self.grad_norm_sq is not None and self.sample_variance is not None

    @property
    def sample_tokens(self) -> float:
        """Tokens per sample (the context the model resolved), from this round's token count."""
        return (self.tokens - self.tokens_before) / (self.steps * self.samples)


def _as_int_keys(mapping: Any) -> dict[int, Any]:
    if not isinstance(mapping, dict):
        return {}
    out = {}
    for key, value in mapping.items():
        try:
            out[int(key)] = value
        except (TypeError, ValueError):
            continue
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _field(mapping: Any, key: str) -> Any:
    return mapping.get(key) if isinstance(mapping, dict) else None


def _round_index(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _count(value: Any, default: int) -> int:
    number = _number(value)
    return int(number) if number is not None and number >= 1 else default


def load_rounds(run_dir: Path) -> tuple[TrainConfig, list[dict[str, Any]], int | None]:
    """The run's config, its "round" records in order and the final record's best trainer (None if unfinished)."""
    run_dir = Path(run_dir)
    config = resume_config(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise DataError(f"'{run_dir}' has no metrics.jsonl: the run has not completed a round yet")
    records = read_metrics(path)
    rounds = sorted(
        (r for r in records if r.get("kind") == "round" and _round_index(r.get("round")) is not None),
        key=lambda r: r["round"],
    )
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    best = _number(final.get("best_trainer")) if final else None
    return config, rounds, int(best) if best is not None else None


def _follow(
    rounds: list[dict[str, Any]], trainer: int, *, trainers: int, workers: int, batch: int, sync_every: int
) -> list[RoundPoint]:
    """The rounds in which ``trainer`` trained, with what it ran each round with.

    ``trainers``, ``workers``, ``batch`` (samples per worker step) and ``sync_every`` (H of the first round) are the
    run's starting settings: what a trainer ran with until a record says otherwise, and what a record lacking a
    field falls back on.
    """
    points = []
    tokens_before = 0
    step_before = 0
    # "batch" and "workers" are written after the round's batch test and merge: a round ran with the values of
    # the record before it. "plan" is the round's own (its samples are below b when switch mode caps them).
    batch_before = {k: batch for k in range(trainers)}
    workers_before = {k: workers for k in range(trainers)}
    for record in rounds:
        batches = {k: _count(b, batch) for k, b in _as_int_keys(record.get("batch")).items()}
        losses = _as_int_keys(record.get("train_loss"))
        plans = _as_int_keys(record.get("plan"))
        ran = {k: _count(_field(plans.get(k), "samples"), batch_before.get(k, batch)) for k in losses}
        steps = _count(record.get("steps"), sync_every)
        tokens = _count(record.get("tokens"), tokens_before)
        step_after = _count(record.get("step"), step_before + steps)
        loss = _number(losses.get(trainer))
        samples = sum(workers_before.get(k, 0) * b for k, b in ran.items())
        workers_after = {k: _count(w, 0) for k, w in _as_int_keys(record.get("workers")).items()} or workers_before
        after = {**batch_before, **batches}
        if loss is not None and trainer in ran and samples > 0 and tokens > tokens_before:
            test = _as_int_keys(record.get("batch_test")).get(trainer)
            points.append(
                RoundPoint(
                    round=int(record["round"]),
                    first_step=step_after - steps,
                    steps=steps,
                    tokens=tokens,
                    tokens_before=tokens_before,
                    loss=loss,
                    workers=workers_before.get(trainer, workers),
                    batch=ran[trainer],
                    batch_after=after.get(trainer, batch),
                    workers_after=workers_after.get(trainer) or workers_before.get(trainer, workers),
                    others_after=sum(w * after.get(k, batch) for k, w in workers_after.items() if k != trainer),
                    samples=samples,
                    grad_norm_sq=_number(_field(test, "grad_norm_sq")),
                    sample_variance=_number(_field(test, "sample_variance")),
                    merged=_merged(record.get("merge"), trainer),
                )
            )
        batch_before, workers_before = after, workers_after
        tokens_before, step_before = tokens, step_after
    return points


def _merged(merge: Any, trainer: int) -> bool:
    if not isinstance(merge, dict):
        return False
    members = merge.get("merged") if isinstance(merge.get("merged"), list) else []
    return merge.get("into") == trainer or trainer in members


def _measured(points: list[RoundPoint], target: float, syncs_per_round: int) -> dict[str, Any] | None:
    for point in points:
        if point.loss <= target:
            return _at_round(point.round, point.tokens, syncs_per_round)
    return None


def _at_round(round_number: int, tokens: float, syncs_per_round: int) -> dict[str, Any]:
    # Rounds are counted from 1: the run is at round n after n rounds.
    return {
        "round": round_number,
        "rounds": round_number,
        "tokens": round(tokens),
        "synchronisations": round_number * syncs_per_round,
    }


def _syncs_per_round(method: str, sync_every: int) -> int:
    """Synchronisations per round of ``method`` with H = ``sync_every``."""
    return METHODS[method].syncs_per_round(sync_every)


def _raw_statistics(points: list[RoundPoint], ema: float) -> list[tuple[RoundPoint, float, float]]:
    """The measured rounds with their single-round ‖∇F‖² and σ², undoing the batch test's EMA
    (``ema``: the run's ``batch.statistics.ema``).

    The controller logs s_t = a·s_{t−1} + (1 − a)·x_t, so x_t = (s_t − a·s_{t−1})/(1 − a): one wild round
    stays one wild round, which the medians below then ignore.
    """
    a = ema
    out = []
    previous: tuple[float, float] | None = None
    for point in points:
        if point.grad_norm_sq is None or point.sample_variance is None:
            continue
        logged = (point.grad_norm_sq, point.sample_variance)
        if a > 0 and previous is not None:
            grad, variance = ((s - a * p) / (1 - a) for s, p in zip(logged, previous, strict=True))
        else:
            grad, variance = logged
        out.append((point, grad, variance))
        previous = logged
    return out


def _fit(
    calibration: list[RoundPoint], where: str, *, ema: float, schedule: Schedule
) -> tuple[LossModel, list[RoundPoint]]:
    """Fit the model to the calibration rounds; also returns the rounds whose loss curve fixed κ.

    ``ema`` is the run's ``batch.statistics.ema``, ``schedule`` its inner learning-rate schedule.

    β comes from the medians of the two halves of the calibration rounds (loss and ‖∇F‖²), G_ref and σ²
    from the later half, and κ from the later half's loss curve.
    """
    half = len(calibration) // 2
    early, late = calibration[:half], calibration[half:]
    measured = _raw_statistics(calibration, ema)
    stats_early, stats_late = measured[: sum(p.measured for p in early)], measured[sum(p.measured for p in early) :]
    if not stats_late or len(late) < 2:
        raise DataError(
            f"nothing to calibrate on: {len(late)} rounds ({len(stats_late)} with batch-test statistics) in the "
            f"later half of {where}; give more --calibrate-rounds"
        )
    # Single-round estimates are noisy and sometimes wild (a loss spike): medians, not means.
    grad_norm_sq = statistics.median(g for _, g, _ in stats_late)
    variance = statistics.median(v for _, _, v in stats_late)
    if grad_norm_sq <= 0 or variance < 0:
        raise DataError(
            f"nothing to calibrate on: the median ‖∇F‖² estimate in the later half of {where} is "
            f"{grad_norm_sq:.3g} (noise dominates the gradient); calibrate on earlier or more rounds"
        )
    slope = 0.0
    if stats_early:
        slope = log_slope(
            statistics.median(p.loss for p, _, _ in stats_early),
            statistics.median(g for _, g, _ in stats_early),
            statistics.median(p.loss for p, _, _ in stats_late),
            grad_norm_sq,
        )
    weights = [
        schedule.round_weight(p.first_step, p.tokens_before, (p.tokens - p.tokens_before) / p.steps) for p in late[1:]
    ]
    batches = [float(p.workers * p.batch) for p in late[1:]]
    try:
        model = fit_scale(
            [p.loss for p in late],
            batches,
            weights,
            slope=slope,
            grad_norm_sq=grad_norm_sq,
            sample_variance=variance,
        )
    except ValueError as error:
        raise DataError(f"nothing to calibrate on in the later half of {where}: {error}") from None
    return model, late


def estimate(
    run_dir: Path, target: float, calibrate_rounds: int | None = None, trainer: int | None = None
) -> dict[str, Any]:
    """Fit the model to the first rounds of ``run_dir``, predict the rounds to ``target`` and compare with the run.

    Raises ConfigError for a bad target, a bad ``calibrate_rounds`` or a run without batch-test statistics,
    and DataError when the run has too few rounds to calibrate on. A target the model never reaches is
    returned with ``prediction.reachable`` false (the CLI turns that into an error).
    """
    _check_arguments(target, calibrate_rounds)
    run_dir = Path(run_dir)
    config, rounds, best = load_rounds(run_dir)
    if trainer is None:
        trainer = best if best is not None else 0
    points = _follow(
        rounds,
        trainer,
        trainers=config.trainers,
        workers=config.workers,
        batch=config.batch.size,
        sync_every=config.first_sync_every,
    )
    if not points:
        raise DataError(f"'{run_dir}' has no completed rounds of trainer {trainer} in metrics.jsonl")
    if not any(p.measured for p in points):
        raise ConfigError(f"run '{run_dir}' {_NO_STATISTICS}")
    count = calibrate_rounds or max(MIN_CALIBRATION, round(CALIBRATE_SHARE * len(points)))
    if count > len(points):
        raise DataError(
            f"nothing to calibrate on: '{run_dir}' has {len(points)} rounds of trainer {trainer}, "
            f"--calibrate-rounds asks for {count}"
        )
    calibration = points[:count]
    inner = config.inner
    schedule = Schedule(inner.lr, inner.min_lr, inner.warmup_steps, config.total_tokens, config.first_sync_every)
    where = f"rounds {calibration[0].round}-{calibration[-1].round} of '{run_dir}'"
    model, window = _fit(calibration, where, ema=config.batch.statistics.ema, schedule=schedule)
    last = calibration[-1]
    syncs = _syncs_per_round(config.method, config.first_sync_every)
    measured = _measured(points, target, syncs)
    prediction = _predict(model, points, last, target, syncs, measured, batch=config.batch, schedule=schedule)
    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "method": config.method,
        "trainer": trainer,
        "target": target,
        "rounds_in_run": len(points),
        "calibration": _calibration_dict(model, window, calibration),
        "merges_after_calibration": sum(p.merged for p in points[count:]),
        "prediction": prediction,
        "measured": measured,
    }
    result["relative_error"] = _relative_error(prediction, measured)
    return result


def _check_arguments(target: float, calibrate_rounds: int | None) -> None:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
        raise ConfigError(f"--target must be a finite loss > 0 (a cross-entropy), got {target!r}")
    if calibrate_rounds is not None and (isinstance(calibrate_rounds, bool) or calibrate_rounds < MIN_CALIBRATION):
        raise ConfigError(f"--calibrate-rounds must be an integer >= {MIN_CALIBRATION}, got {calibrate_rounds!r}")


def _predict(
    model: LossModel,
    points: list[RoundPoint],
    last: RoundPoint,
    target: float,
    syncs: int,
    measured: dict[str, Any] | None,
    *,
    batch: BatchConfig,
    schedule: Schedule,
) -> dict[str, Any]:
    """Rounds to the target after the calibration, or the observation when it was reached during it.

    ``batch`` (the run's batch section) says whether the norm test grew b, and with which η up to which cap.
    """
    if measured is not None and measured["round"] <= last.round:
        # Reached inside the calibration rounds: that observation is the answer, nothing is predicted.
        prediction: dict[str, Any] = {
            "reachable": True,
            "during_calibration": True,
            "more_rounds": 0,
            **measured,
            "final_batch": next(p.batch for p in points if p.round == measured["round"]),
        }
        return prediction
    norm_test = batch.test == "norm" and batch.b_cap > batch.b_min
    path = rounds_to_target(
        model,
        last.loss,
        target,
        workers=last.workers_after,
        batch=last.batch_after,
        schedule=schedule,
        step=last.first_step + last.steps,
        tokens=last.tokens,
        sample_tokens=last.sample_tokens,
        other_samples=last.others_after,
        eta=batch.statistics.eta if norm_test else None,
        batch_cap=batch.b_cap if norm_test else None,
        max_rounds=HORIZON * len(points),
    )
    return _prediction_dict(path, last, syncs)


def _calibration_dict(model: LossModel, window: list[RoundPoint], calibration: list[RoundPoint]) -> dict[str, Any]:
    last = calibration[-1]
    return {
        "rounds": len(calibration),
        "first_round": calibration[0].round,
        "last_round": last.round,
        "loss_start": calibration[0].loss,
        "loss_end": last.loss,
        "fit_first_round": window[0].round,
        "scale": model.scale,
        "slope": model.slope,
        "reference_loss": model.ref_loss,
        "grad_norm_sq": model.ref_grad_norm_sq,
        "sample_variance": model.sample_variance,
        "noise_scale": model.sample_variance / model.ref_grad_norm_sq,
        "merges": sum(p.merged for p in calibration),
    }


def _prediction_dict(path: RoundsPrediction, last: RoundPoint, syncs: int) -> dict[str, Any]:
    if path.rounds is None:
        return {"reachable": False, "reason": path.reason}
    if path.rounds == 0:  # the last calibration loss is at the target but an earlier round was not
        return {"reachable": True, "more_rounds": 0, **_at_round(last.round, last.tokens, syncs)}
    return {
        "reachable": True,
        "more_rounds": path.rounds,
        **_at_round(last.round + path.rounds, path.tokens[-1], syncs),
        "final_batch": path.batches[-1],
    }


def _relative_error(prediction: dict[str, Any], measured: dict[str, Any] | None) -> float | None:
    if measured is None or "rounds" not in prediction or prediction.get("during_calibration"):
        return None
    return (prediction["rounds"] - measured["rounds"]) / measured["rounds"]


def unreachable_message(result: dict[str, Any]) -> str:
    """One line for a target the model never reaches."""
    cal = result["calibration"]
    return (
        f"loss {result['target']:g} is not reached under the model calibrated on rounds {cal['first_round']}-"
        f"{cal['last_round']} of '{result['run_dir']}': {result['prediction']['reason']}"
    )


def format_estimate(result: dict[str, Any]) -> str:
    """Human-readable lines for the command's default output."""
    cal = result["calibration"]
    lines = [
        f"run {result['run_dir']} ({result['method']}, trainer {result['trainer']}, {result['rounds_in_run']} rounds)",
        f"calibrated on rounds {cal['first_round']}-{cal['last_round']} (fit on {cal['fit_first_round']}-"
        f"{cal['last_round']}): loss {cal['loss_start']:.4f} -> {cal['loss_end']:.4f}, kappa {cal['scale']:.4g}, "
        f"beta {cal['slope']:.4g}, |grad F|^2 {cal['grad_norm_sq']:.4g} and sigma^2 {cal['sample_variance']:.4g} "
        f"at loss {cal['reference_loss']:.4f} (noise scale {cal['noise_scale']:.4g} samples)",
    ]
    pred = result["prediction"]
    target = result["target"]
    if pred.get("during_calibration"):
        lines.append(
            f"predicted: nothing to predict, the run reached loss {target:g} at round {pred['round']}, "
            "during the calibration rounds"
        )
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
    merges = cal["merges"] + result["merges_after_calibration"]
    if merges:
        lines.append(
            f"note: trainer {result['trainer']} took part in {merges} merge(s) ({cal['merges']} during calibration); "
            "the model does not follow merges (docs/estimate.md)"
        )
    return "\n".join(lines)
