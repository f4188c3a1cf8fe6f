"""Experiment trackers: every metrics record also goes to TensorBoard, W&B, MLflow or ClearML.

The run's :class:`~adloco.metrics.writer.MetricsWriter` fans each record out to the trackers named in ``run.trackers``.
Records become scalars by one rule (:func:`scalars_of`) so that every tracker sees the same tags, all on one
x axis: the **global inner step** (``step`` in ``metrics.jsonl``). Round records are logged at the inner step
that ended the round, so resuming from a checkpoint can hide the replaced points with a single step threshold.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from adloco.config import ConfigError

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow", "clearml")

# Module that must import, and the pip command that provides it.
_REQUIREMENTS = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'adloco[wandb]'"),
    "mlflow": ("mlflow", "pip install 'adloco[mlflow]'"),
    "clearml": ("clearml", "pip install 'adloco[clearml]'"),
}


class Tracker(Protocol):
    """Receives every metrics record; ``step`` is the global inner step the record belongs to."""

    def record(self, kind: str, fields: dict[str, Any], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Iterable[str]) -> None:
    """Raise a one-line ConfigError when a requested tracker's package is not installed."""
    for name in names:
        if name not in _REQUIREMENTS:
            raise ConfigError(f"run.trackers: unknown tracker '{name}' (choose from {', '.join(TRACKERS)})")
        module, install = _REQUIREMENTS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.trackers: '{name}' is not installed; install it with: {install}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def scalars_of(kind: str, fields: dict[str, Any]) -> dict[str, float]:
    """The scalar tags one metrics record contributes (non-finite values are skipped)."""
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        number = _number(value)
        if number is not None and number == number and abs(number) != float("inf"):
            out[tag] = number

    def per_trainer(prefix: str, values: Any) -> None:
        for trainer, value in (values or {}).items():
            put(f"{prefix}/trainer_{trainer}", value)

    if kind == "step":
        per_trainer("train/loss", fields.get("loss"))
        put("train/lr", fields.get("lr"))
        put("progress/tokens", fields.get("tokens"))
    elif kind == "round":
        per_trainer("round/train_loss", fields.get("train_loss"))
        per_trainer("val/loss", fields.get("val_loss"))
        per_trainer("batch/b", fields.get("batch"))
        per_trainer("batch/workers", fields.get("workers"))
        put("progress/round", fields.get("round", 0))  # counted from 1, as everywhere
        put("comm/bytes", fields.get("bytes"))
        put("comm/bytes_total", fields.get("bytes_total"))
        put("comm/seconds", fields.get("comm_seconds"))
        put("comm/peak_sync_bytes", fields.get("peak_sync_bytes"))
        put("perf/tokens_per_second", fields.get("tokens_per_second"))
        put("perf/mfu", fields.get("mfu"))
        put("perf/round_seconds", fields.get("round_seconds"))
        put("perf/seconds", fields.get("seconds"))
        for entry in fields.get("memory") or []:
            for key, value in entry.items():
                if key != "rank":
                    put(f"memory/rank_{entry.get('rank', 0)}/{key}", value)
        put("merge/merged", 1.0 if fields.get("merge") else 0.0)
    elif kind == "final":
        per_trainer("final/val_loss", fields.get("val_loss"))
        put("final/perplexity", fields.get("perplexity"))
    return out


def describe_merge(fields: dict[str, Any]) -> str:
    """One line for a merge record: who merged into whom, with which weights."""
    weights = ", ".join(f"{w:.3f}" for w in fields.get("weights", []))
    return (
        f"round {fields.get('round')}: trainers {fields.get('merged')} merged into {fields.get('into')} "
        f"(weights {weights}; b = {fields.get('batch_size')}, workers {fields.get('workers')})"
    )


class TensorBoardTracker:
    """Event files under ``<run>/tensorboard``; merges as text. Resuming purges the points after the checkpoint."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step makes TensorBoard hide every point at or after it that an earlier, interrupted process wrote.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=60)

    def record(self, kind: str, fields: dict[str, Any], step: int) -> None:
        for tag, value in scalars_of(kind, fields).items():
            self.writer.add_scalar(tag, value, global_step=step)
        if kind == "merge":
            self.writer.add_text("merges", describe_merge(fields), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases (``WANDB_MODE=offline`` works without an account); the run id is the run directory name."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        wandb = importlib.import_module("wandb")
        self.run = wandb.init(
            project=project, name=run_dir.name, id=run_dir.name, resume="allow", dir=str(run_dir), config=config
        )
        self.merges: list[str] = []

    def record(self, kind: str, fields: dict[str, Any], step: int) -> None:
        scalars = scalars_of(kind, fields)
        if scalars:
            self.run.log(scalars, step=step)
        if kind == "merge":
            self.merges.append(describe_merge(fields))
            self.run.summary["merges"] = "\n".join(self.merges)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow (tracking server from ``MLFLOW_TRACKING_URI``); one MLflow run per run directory, kept on resume."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        self.mlflow = importlib.import_module("mlflow")
        self.mlflow.set_experiment(project)
        marker = run_dir / "tracking" / "mlflow_run_id"
        run_id = marker.read_text().strip() if marker.exists() else None
        self.run = self.mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
        if run_id is None:
            marker.parent.mkdir(exist_ok=True)
            marker.write_text(self.run.info.run_id + "\n")
            self.mlflow.log_params(_flat(config))
        self.merges: list[str] = []

    def record(self, kind: str, fields: dict[str, Any], step: int) -> None:
        scalars = scalars_of(kind, fields)
        if scalars:
            # MLflow metric names allow '/', so the tags are the same as TensorBoard's.
            self.mlflow.log_metrics(scalars, step=step)
        if kind == "merge":
            self.merges.append(describe_merge(fields))
            self.mlflow.log_text("\n".join(self.merges) + "\n", "merges.txt")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


class ClearmlTracker:
    """ClearML (server and credentials from ``clearml.conf`` or ``CLEARML_*`` variables)."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        clearml = importlib.import_module("clearml")
        self.task = clearml.Task.init(project_name=project, task_name=run_dir.name, reuse_last_task_id=True)
        self.task.connect(_flat(config))
        self.logger = self.task.get_logger()

    def record(self, kind: str, fields: dict[str, Any], step: int) -> None:
        for tag, value in scalars_of(kind, fields).items():
            title, _, series = tag.rpartition("/")
            self.logger.report_scalar(title=title or tag, series=series, value=value, iteration=step)
        if kind == "merge":
            self.logger.report_text(describe_merge(fields), iteration=step)

    def flush(self) -> None:
        self.logger.flush()

    def close(self) -> None:
        self.task.close()


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"inner": {"lr": 1e-3}}`` → ``{"inner.lr": 1e-3}`` (trackers' parameter tables are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, int | float | str | bool) else str(value)
    return out


def open_trackers(
    names: Sequence[str],
    run_dir: Path,
    project: str = "adloco",
    config: dict[str, Any] | None = None,
    resume_step: int | None = None,
) -> list[Tracker]:
    """Start the named trackers for ``run_dir``; ``resume_step`` is the checkpoint's global inner step."""
    check_trackers(names)
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            purge = resume_step + 1 if resume_step is not None else None
            trackers.append(TensorBoardTracker(run_dir / "tensorboard", purge_step=purge))
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, project, config or {}))
        elif name == "mlflow":
            trackers.append(MlflowTracker(run_dir, project, config or {}))
        elif name == "clearml":
            trackers.append(ClearmlTracker(run_dir, project, config or {}))
    return trackers


class FanOut:
    """Sends each record to every tracker; a tracker that fails is dropped with a warning, never the run."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)
        self.step = 0  # records without a step (merge, final) belong to the last step seen

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        if isinstance(fields.get("step"), int):
            self.step = fields["step"]
        self._each("record", kind, fields, self.step)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        self.trackers = []

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # a tracker's outage must not cost the training run
                log.warning(
                    "tracker %s failed (%s: %s); it is switched off",
                    type(tracker).__name__,
                    type(error).__name__,
                    error,
                )
                self.trackers.remove(tracker)
                if method != "close":
                    with contextlib.suppress(Exception):
                        tracker.close()
