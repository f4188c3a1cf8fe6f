"""PNG plots of a run from its metrics.jsonl: loss vs tokens, rounds and bytes with merges; b and the inner lr
factor per trainer; memory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from adloco.checkpoint import CheckpointError
from adloco.errors import DataError
from adloco.metrics.writer import read_metrics

# x coordinate of a round record on each of the loss plot's three axes
_AXES = (("tokens", "training tokens"), ("rounds", "rounds (synchronisations)"), ("bytes_total", "bytes sent"))


def _series(records: list[dict], key: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per trainer: (tokens, round, bytes so far, value) at every round record that has ``key``."""
    out: dict[str, list[tuple[float, float, float, float]]] = {}
    for record in records:
        values = record.get(key)
        if record["kind"] != "round" or not isinstance(values, dict):  # by trainer (an old replica's: one float)
            continue
        for trainer, value in values.items():
            if isinstance(value, int | float):  # non-finite values are stored as strings
                out.setdefault(trainer, []).append((record["tokens"], record["round"], _bytes(record), value))
    return out


def _merge_points(records: list[dict]) -> list[tuple[tuple[float, float, float], str]]:
    """For every merge: its (tokens, rounds, bytes) position, from the round it happened in, and a label."""
    by_round = {r["round"]: r for r in records if r["kind"] == "round"}
    out = []
    for merge in (r for r in records if r["kind"] == "merge"):
        record = by_round.get(merge["round"])
        if record is None:
            continue
        others = ",".join(str(t) for t in merge.get("merged", []) if t != merge.get("into"))
        out.append(((record["tokens"], merge["round"], _bytes(record)), f"{others}→{merge.get('into')}"))
    return out


def _bytes(record: dict) -> float:
    """The bytes sent up to a round; NaN (not drawn) where a record has none (a replica's from before they were
    recorded)."""
    value = record.get("bytes_total")
    return float(value) if isinstance(value, int | float) else math.nan


def _memory_series(records: list[dict]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Per (rank, field): (rounds, MiB) for every round record carrying a memory report."""
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for record in records:
        if record["kind"] != "round":
            continue
        for entry in record.get("memory") or []:
            for field, value in entry.items():
                if field != "rank" and isinstance(value, int | float):
                    out.setdefault((entry.get("rank", 0), field), []).append((record["round"], value))
    return out


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    staging = path.with_name(f".{path.name}.tmp")
    figure.savefig(staging, dpi=110, format="png")
    plt.close(figure)
    staging.replace(path)  # a good plot is replaced whole or not at all
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write the plots into ``run_dir/plots`` and return their paths (memory.png only when memory was recorded)."""
    import matplotlib

    matplotlib.use("Agg")

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise CheckpointError(f"'{run_dir}' has no metrics.jsonl to plot")
    try:
        records = read_metrics(path, strict=True)  # a damaged file would draw blank plots over good ones
    except OSError as error:
        raise DataError(f"'{path}' cannot be read: {error.strerror}") from None
    if not any(r.get("kind") == "round" for r in records):
        raise DataError(f"'{path}' holds no completed round yet: nothing to plot")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    merges = _merge_points(records)
    written = [_plot_loss(records, merges, run_dir.name, out_dir / "loss.png")]
    written.append(_plot_batch(records, merges, out_dir / "batch.png"))
    memory = _memory_series(records)
    if memory:
        written.append(_plot_memory(memory, merges, run_dir.name, out_dir / "memory.png"))
    return written


def _mark_merges(axis: Any, merges: list, column: int, labels: bool = True) -> None:
    for position, text in merges:
        axis.axvline(position[column], color="grey", ls=":", lw=1)
        if labels:
            axis.annotate(
                text, (position[column], 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top"
            )


def _plot_loss(records: list[dict], merges: list, name: str, path: Path) -> Path:
    """Training and validation loss per trainer against tokens, rounds and bytes."""
    import matplotlib.pyplot as plt

    val, train = _series(records, "val_loss"), _series(records, "train_loss")
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, column, (_, label) in zip(axes, (0, 1, 2), _AXES, strict=True):
        for trainer, points in sorted(train.items()):
            axis.plot(
                [p[column] for p in points], [p[3] for p in points], alpha=0.35, label=f"train, trainer {trainer}"
            )
        for trainer, points in sorted(val.items()):
            axis.plot(
                [p[column] for p in points], [p[3] for p in points], marker="o", ms=3, label=f"val, trainer {trainer}"
            )
        _mark_merges(axis, merges, column)
        axis.set_xlabel(label)
        axis.set_ylabel("loss (nats per token)")
        axis.grid(alpha=0.3)
    if any(p[2] > 0 for points in (*train.values(), *val.values()) for p in points):
        axes[2].set_xscale("log")  # a run that sent nothing (one worker) has no bytes to spread out
    if train or val:
        axes[0].legend(fontsize=7)
    figure.suptitle(f"{name}: loss" + (" (dotted: merges, merged → kept trainer)" if merges else ""))
    return _save(figure, path)


def _plot_batch(records: list[dict], merges: list, path: Path) -> Path:
    """b per trainer over the rounds and, where recorded, the factor on its inner lr that follows b."""
    import matplotlib.pyplot as plt

    panels = [("per-worker batch b", "batch size per trainer (dotted: merges)", _series(records, "batch"))]
    lr_scale = _series(records, "lr_scale")
    if lr_scale:
        panels.append(("inner lr factor", "inner lr × (b / batch.size)^α per trainer", lr_scale))
    chosen = [(r["round"], r["sync_every"]) for r in records if r.get("kind") == "round" and _auto(r)]
    if chosen:  # sync_every=auto: H per round, for the whole run
        panels.append(("H (inner steps)", "H per round (sync_every=auto)", {"H": [(0, n, 0, h) for n, h in chosen]}))
    figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for axis, (ylabel, title, series) in zip(axes[0], panels, strict=True):
        for trainer, points in sorted(series.items()):
            label = trainer if trainer == "H" else f"trainer {trainer}"
            axis.step([p[1] for p in points], [p[3] for p in points], where="post", label=label)
        _mark_merges(axis, merges, 1)
        axis.set_xlabel("round")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if series:
            axis.legend(fontsize=8)
    return _save(figure, path)


def _auto(record: dict) -> bool:
    """A round whose H was chosen while training (its decision has a reason other than ``fixed``)."""
    return (record.get("sync") or {}).get("reason", "fixed") != "fixed" and "sync_every" in record


def _plot_memory(memory: dict, merges: list, name: str, path: Path) -> Path:
    """Process memory per rank, and CUDA memory beside it where recorded (dashed: peaks)."""
    import matplotlib.pyplot as plt

    cuda = any(field.startswith("cuda") for _, field in memory)
    figure, axes = plt.subplots(1, 2 if cuda else 1, figsize=(13 if cuda else 7, 4), squeeze=False)
    panels = [("process memory (RSS) per rank", ("rss_mib", "peak_rss_mib"))]
    if cuda:
        panels.append(("CUDA memory per rank", ("cuda_allocated_mib", "cuda_peak_allocated_mib")))
    for axis, (title, fields) in zip(axes[0], panels, strict=True):
        for (rank, field), points in sorted(memory.items()):
            if field in fields:
                style = "--" if "peak" in field else "-"
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=f"rank {rank}: {field}")
        _mark_merges(axis, merges, 1, labels=False)
        axis.set_xlabel("round")
        axis.set_ylabel("MiB")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"{name}: memory (dashed: peak)")
    return _save(figure, path)
