"""PNG plots of a run from its metrics.jsonl: loss vs tokens, rounds and bytes; b per trainer."""

from __future__ import annotations

from pathlib import Path

from adloco.checkpoint import CheckpointError
from adloco.metrics import read_metrics


def _series(records: list[dict], key: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per trainer: (tokens, round, bytes so far, value) at every round record that has ``key``."""
    out: dict[str, list[tuple[float, float, float, float]]] = {}
    for record in records:
        values = record.get(key)
        if record["kind"] != "round" or not values:
            continue
        for trainer, value in values.items():
            out.setdefault(trainer, []).append((record["tokens"], record["round"] + 1, record["bytes_total"], value))
    return out


def plot_run(run_dir: Path) -> list[Path]:
    """Write the plots into ``run_dir/plots`` and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise CheckpointError(f"'{run_dir}' has no metrics.jsonl to plot")
    records = read_metrics(path)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    val, train = _series(records, "val_loss"), _series(records, "train_loss")
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, column, label in zip(
        axes, (0, 1, 2), ("training tokens", "rounds (synchronisations)", "bytes sent"), strict=True
    ):
        for trainer, points in sorted(train.items()):
            axis.plot(
                [p[column] for p in points], [p[3] for p in points], alpha=0.35, label=f"train, trainer {trainer}"
            )
        for trainer, points in sorted(val.items()):
            axis.plot(
                [p[column] for p in points], [p[3] for p in points], marker="o", ms=3, label=f"val, trainer {trainer}"
            )
        axis.set_xlabel(label)
        axis.set_ylabel("loss (nats per token)")
        axis.grid(alpha=0.3)
    axes[2].set_xscale("log")
    axes[0].legend(fontsize=7)
    figure.suptitle(f"{run_dir.name}: loss")
    figure.tight_layout()
    written.append(out_dir / "loss.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    batch = _series(records, "batch")
    merges = [r for r in records if r["kind"] == "merge"]
    figure, axis = plt.subplots(figsize=(7, 4))
    for trainer, points in sorted(batch.items()):
        axis.step([p[1] for p in points], [p[3] for p in points], where="post", label=f"trainer {trainer}")
    for merge in merges:
        axis.axvline(merge["round"] + 1, color="grey", ls=":", lw=1)
    axis.set_xlabel("round")
    axis.set_ylabel("per-worker batch b")
    axis.set_title("batch size per trainer (dotted: merges)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    written.append(out_dir / "batch.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)
    return written
