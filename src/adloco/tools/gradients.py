"""``adloco gradients RUN_DIR``: measure the gradient noise of a finished run at its final θ or a checkpoint.

N training samples (windows of the corpus, or labelled rows for classification) are drawn from the run's
task with a fixed seed; their per-sample gradients (one backward pass each, exact) give the full gradient
g = mean a_i, tr Cov and the simple noise scale. Random batches of B distinct samples then show how far a
batch gradient strays from g, next to the prediction tr Cov·(1 − B/N)/(B‖g‖²). The batch tests of the run
(algorithms/batch_tests.py) are applied to the same statistics, so their choice can be compared with the b
the run ended with. The math lives in :mod:`adloco.algorithms.noise`; this module loads, computes
gradients, writes the report and the plots.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adloco.algorithms.batch_tests import BatchSizeController, GradientStatistics, statistics_from_gram
from adloco.algorithms.noise import batch_deviations, gram_of_rows, predicted_deviation, simple_noise_scale
from adloco.algorithms.sharding import ShardLayout
from adloco.checkpoint import TRAIN, CheckpointError, checkpoint_round, list_checkpoints, load_checkpoint, read_manifest
from adloco.config import BatchConfig, ConfigError, resume_config
from adloco.data import SAVED_DIR, build_tokenizer, load_corpus
from adloco.metrics.writer import read_metrics
from adloco.workers.tasks import Task, build_task, load_theta

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_SAMPLES = 128
DEFAULT_REPEATS = 1000
REPORT_FILE = "report.json"


@dataclass(frozen=True)
class Source:
    """Where the analysed θ comes from, and what the run had there: b and workers of that trainer."""

    kind: str  # "final" or "checkpoint"
    round: int | None
    trainer: int | None
    run_batch: int | None
    workers: int

    def label(self) -> str:
        where = "final model" if self.kind == "final" else f"checkpoint of round {self.round}"
        return where if self.trainer is None else f"{where}, trainer {self.trainer}"


def parse_batch_sizes(text: str | None, samples: int) -> list[int]:
    """``"1,2,4"`` → [1, 2, 4]: distinct integers in [1, samples], sorted; ConfigError otherwise.

    None gives the default sizes up to ``samples``.
    """
    if samples < 2:
        raise ConfigError(f"--samples must be >= 2 to measure a variance, got {samples}")
    if text is None:
        return [b for b in DEFAULT_BATCH_SIZES if b <= samples]
    sizes = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--batch-sizes: '{item}' is not an integer (give e.g. 1,2,4,8)") from None
        if value < 1 or value > samples:
            raise ConfigError(f"--batch-sizes: {value} is outside 1..{samples} (the number of --samples)")
        sizes.append(value)
    return sorted(set(sizes))


def parse_checkpoint(text: str | None) -> str | int | None:
    """None (final if exported, else latest), ``"final"``, ``"latest"`` or a round number."""
    if text is None or text in ("final", "latest"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"--checkpoint must be 'final', 'latest' or a round number >= 0, got '{text}'")
    return value


def _round_records(run_dir: Path) -> tuple[list[dict], dict | None]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], None
    try:
        records = read_metrics(path)
    except (OSError, ValueError):
        log.warning("'%s' is unreadable; the run's own b is not reported", path)
        return [], None
    rounds = [r for r in records if r.get("kind") == "round"]
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    return rounds, final


def _final_source(run_dir: Path, workers: int) -> Source:
    """The exported model's trainer (the best one) with its b and workers of the last round.

    ``workers`` is the run's starting count, for a run whose records do not say.
    """
    rounds, final = _round_records(run_dir)
    trainer = final.get("best_trainer") if final else None
    last = rounds[-1] if rounds else {}
    key = str(trainer)
    run_batch = (last.get("batch") or {}).get(key)
    last_workers = (last.get("workers") or {}).get(key, workers)
    return Source("final", None, trainer, run_batch, int(last_workers))


def _checkpoint_path(directory: Path, round_index: int | str) -> tuple[Path, str | None]:
    available = list_checkpoints(directory)
    if not available:
        raise CheckpointError(f"'{directory.parent}' has no checkpoints in {directory.name}/")
    by_round = {checkpoint_round(p): p for p in available}
    path = available[-1] if round_index == "latest" else by_round.get(int(round_index))
    if path is None:
        rounds = ", ".join(str(r) for r in by_round)
        raise CheckpointError(f"no checkpoint of round {round_index} in '{directory}' (available: {rounds})")
    sha256 = next((e.get("sha256") for e in read_manifest(directory) if e.get("file") == path.name), None)
    return path, sha256


def _load_checkpoint(
    run_dir: Path, path: Path, sha256: str | None, model: torch.nn.Module, trainer: int | None
) -> Source:
    """Load one trainer's θ of the checkpoint at ``path`` into ``model`` (built from the run's task and seed).

    None picks the trainer with the best validation loss at that round, if it was evaluated; else the first.
    """
    whole = ShardLayout(0, 1, lambda: {tuple(p.shape) for p in model.parameters()})  # sharded workers' θ joined
    state = load_checkpoint(path, sha256, TRAIN, layout=whole)  # a train run's: its trainers and round are there
    trainers, saved_round = state["cluster"]["trainers"], int(state["round"])
    if trainer is None:
        rounds, _ = _round_records(run_dir)
        val = next((r.get("val_loss") for r in rounds if r.get("round") == saved_round), None) or {}
        candidates = {int(k): v for k, v in val.items() if int(k) in trainers}
        trainer = min(candidates, key=candidates.get) if candidates else min(trainers)
    if trainer not in trainers:
        raise CheckpointError(f"checkpoint '{path}' has no trainer {trainer} (trainers: {sorted(trainers)})")
    saved = trainers[trainer]
    theta = saved["theta"]
    if [tuple(t.shape) for t in theta] != [tuple(p.shape) for p in model.parameters()]:
        raise CheckpointError(f"checkpoint '{path}' holds parameters of another model shape than the run's config")
    load_theta(model, theta)
    return Source("checkpoint", saved_round, trainer, int(saved["batch_size"]), len(saved["worker_ids"]))


def load_parameters(
    run_dir: Path, checkpoint: str | int | None = None, trainer: int | None = None
) -> tuple[torch.nn.Module, Task, Source]:
    """The model at the requested θ and the run's task (built from the run's saved config): ``final`` (exported
    best trainer), ``latest`` or a round. None picks ``final`` when the run exported a model and the latest
    checkpoint otherwise."""
    config = resume_config(run_dir)

    def task_of(tokenizer: Any, model_config: Any = None) -> Task:
        return build_task(config.task, config.model, config.data, config.seed, tokenizer,
                          lambda context: load_corpus(config.data, tokenizer, context), model_config)  # fmt: skip

    has_final = (run_dir / "final" / "config.json").exists()
    if checkpoint is None:
        if not has_final and not list_checkpoints(run_dir / "checkpoints"):
            raise CheckpointError(f"'{run_dir}' has neither an exported model (final/) nor a checkpoint")
        checkpoint = "final" if has_final else "latest"
    if checkpoint == "final":
        if trainer is not None:
            raise ConfigError("--trainer selects a trainer of a checkpoint; the final model is the best trainer's")
        from adloco.tools.inference import load_final

        model, tokenizer = load_final(run_dir)
        return model, task_of(tokenizer, model.config), _final_source(run_dir, config.workers)
    path, sha256 = _checkpoint_path(run_dir / "checkpoints", checkpoint)
    # The run's own tokenizer: a trained BPE is reloaded from the run, never trained again.
    tokenizer = build_tokenizer(config.data, None, None if config.data.tokenizer == "byte" else run_dir / SAVED_DIR)
    task = task_of(tokenizer)
    model = task.build_model(config.seed)
    source = _load_checkpoint(run_dir, path, sha256, model, trainer)
    return model.eval(), task, source


def draw_samples(task: Task, samples: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``samples`` training samples of the run's task, drawn as a worker's stream draws them, from ``seed``."""
    return task.stream(seed, worker=0, workers=1).next_batch(samples)


def per_sample_gradients(
    model: torch.nn.Module, loss: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """N×d float32 matrix: row i is ∇ of ``loss`` on sample i alone (one backward pass per sample).

    ``batch`` holds tensors with one row per sample, as a task's stream returns them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    count = batch[0].shape[0]
    rows = torch.empty(count, total, dtype=torch.float32)
    for i in range(count):
        model.zero_grad(set_to_none=True)
        loss(model, *(t[i : i + 1] for t in batch)).backward()
        offset = 0
        for p in params:
            n = p.numel()
            rows[i, offset : offset + n] = 0.0 if p.grad is None else p.grad.reshape(-1)
            offset += n
    model.zero_grad(set_to_none=True)
    return rows


def _check_memory(samples: int, parameters: int) -> None:
    needed = samples * parameters * 4
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if needed > 0.8 * available:
        raise ConfigError(
            f"--samples {samples} needs {needed / 2**30:.1f} GiB for the per-sample gradients of {parameters:,} "
            f"parameters, more than the {available / 2**30:.1f} GiB available; lower --samples"
        )


def analyze(
    run_dir: Path,
    *,
    checkpoint: str | int | None = None,
    trainer: int | None = None,
    samples: int = DEFAULT_SAMPLES,
    batch_sizes: list[int] | tuple[int, ...] = DEFAULT_BATCH_SIZES,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    out_dir: Path | None = None,
    plots: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Measure the gradient noise of a run, write ``report.json`` (and PNGs) into ``out_dir``; return the report.

    ``threads`` (default: the run's ``threads`` setting) sets torch's CPU threads for the duration of the call.
    """
    if samples < 2:
        raise ConfigError(f"--samples must be >= 2 to measure a variance, got {samples}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    bad = [b for b in batch_sizes if b < 1 or b > samples]
    if bad or not batch_sizes:
        raise ConfigError(f"--batch-sizes must lie in 1..{samples} (the number of --samples), got {bad or 'none'}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    config = resume_config(run_dir)
    previous_threads = torch.get_num_threads()
    threads = threads or config.threads
    if threads:
        torch.set_num_threads(threads)
    try:
        model, task, source = load_parameters(run_dir, checkpoint, trainer)
        return _analyze(run_dir, model, task, source, config.batch, samples, batch_sizes, repeats, seed, out_dir, plots)
    finally:
        torch.set_num_threads(previous_threads)


def _analyze(
    run_dir: Path,
    model: torch.nn.Module,
    task: Task,
    source: Source,
    batch: BatchConfig,
    samples: int,
    batch_sizes: list[int] | tuple[int, ...],
    repeats: int,
    seed: int,
    out_dir: Path | None,
    plots: bool,
) -> dict[str, Any]:
    """The report on ``model`` (loaded from ``source``); ``batch`` is the run's batch section, for its tests."""
    model = model.float().eval()
    parameters = sum(p.numel() for p in model.parameters())
    _check_memory(samples, parameters)
    gram, stats, mean_check = _sample_statistics(model, task, draw_samples(task, samples, seed), samples)
    deviations, rows_out = _deviation_rows(gram, stats, batch_sizes, repeats, seed, samples)
    unbiased = stats.unbiased_grad_norm_sq
    report: dict[str, Any] = {
        "run_dir": str(run_dir),
        "task": task.name,
        "source": {"kind": source.kind, "round": source.round, "trainer": source.trainer},
        "samples": samples,
        "seed": seed,
        "context": task.context,
        "parameters": parameters,
        "grad_norm_sq": stats.grad_norm_sq,
        "unbiased_grad_norm_sq": unbiased,
        "trace_cov": stats.sample_variance,
        "ip_variance": stats.ip_variance,
        "orth_variance": stats.orth_variance,
        "noise_scale": simple_noise_scale(stats.sample_variance, stats.grad_norm_sq),
        "noise_scale_unbiased": (stats.sample_variance / unbiased if unbiased > 0 else math.inf),
        "mean_gradient_check": mean_check,
        **_batch_test_requests(stats, batch, source.workers),
        "b_bounds": [batch.b_min, batch.b_cap],
        "run_batch": source.run_batch,
        "run_batch_test": _run_batch_test(run_dir, source),
        "batch_sizes": rows_out,
    }
    out_dir = out_dir or run_dir / "gradients"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = write_plots(out_dir, deviations, report) if plots else []
    report["files"] = [str(p) for p in [out_dir / REPORT_FILE, *files]]
    (out_dir / REPORT_FILE).write_text(json.dumps(_finite(report), indent=2) + "\n")
    return report


def _sample_statistics(
    model: torch.nn.Module, task: Task, batch: tuple, samples: int
) -> tuple[torch.Tensor, GradientStatistics, float]:
    """Gram matrix and exact statistics of the per-sample gradients, and how far their mean is from the
    whole-batch gradient (relative squared error; it should be rounding only)."""
    rows = per_sample_gradients(model, task.loss, batch)
    gram = gram_of_rows(rows)
    # Both tasks' losses are means over equal-weight samples (an lm window always holds `context` targets),
    # so the whole-batch gradient must be the mean of the per-sample ones.
    model.zero_grad(set_to_none=True)
    task.loss(model, *batch).backward()
    batch_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    mean_grad = rows.double().mean(dim=0)
    mean_check = float(((batch_grad - mean_grad) ** 2).sum() / (mean_grad**2).sum())
    model.zero_grad(set_to_none=True)
    del rows
    stats = statistics_from_gram(gram, [1] * samples)
    if stats.grad_norm_sq <= 0.0:
        raise CheckpointError("the mean gradient over the samples is exactly zero; nothing to compare against")
    return gram, stats, mean_check


def _batch_test_requests(stats: GradientStatistics, batch_config: BatchConfig, workers: int) -> dict[str, Any]:
    """What the norm and augmented inner-product tests (set as in ``batch_config``) ask for at these statistics."""
    statistics = batch_config.statistics
    norm = BatchSizeController(
        "norm", eta=statistics.eta, b_min=batch_config.b_min, b_cap=batch_config.b_cap, allow_shrink=True
    ).decide(stats, workers, batch_config.b_min)
    inner = BatchSizeController(
        "inner_product",
        theta=statistics.theta,
        nu=statistics.nu,
        b_min=batch_config.b_min,
        b_cap=batch_config.b_cap,
        allow_shrink=True,
    ).decide(stats, workers, batch_config.b_min)
    return {
        "norm_test": {
            "eta": statistics.eta,
            "workers": workers,
            "raw_request": norm.raw_request,
            "b_req": norm.b_req,
            "noise_dominated": norm.noise_dominated,
        },
        "inner_product_test": {
            "theta": statistics.theta,
            "nu": statistics.nu,
            "workers": workers,
            "ip_request": inner.ip_request,
            "orth_request": inner.orth_request,
            "raw_request": inner.raw_request,
            "b_req": inner.b_req,
        },
    }


def _deviation_rows(
    gram: torch.Tensor,
    stats: GradientStatistics,
    batch_sizes: list[int] | tuple[int, ...],
    repeats: int,
    seed: int,
    samples: int,
) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
    """Measured against predicted batch-gradient deviation for each batch size."""
    generator = torch.Generator().manual_seed(seed + 1)
    deviations: dict[int, torch.Tensor] = {}
    rows_out = []
    for b in batch_sizes:
        values = batch_deviations(gram, b, repeats, generator)
        deviations[b] = values
        predicted = predicted_deviation(stats.sample_variance, stats.grad_norm_sq, b, population=samples)
        measured = float(values.mean())
        rows_out.append(
            {
                "batch": b,
                "repeats": repeats,
                "measured": measured,
                "measured_std_error": float(values.std()) / math.sqrt(repeats) if repeats > 1 else None,
                "predicted": predicted,
                "predicted_with_replacement": predicted_deviation(stats.sample_variance, stats.grad_norm_sq, b),
                "ratio": measured / predicted if predicted > 0 else None,
                "median_relative_norm": float(values.sqrt().median()),
            }
        )
    return deviations, rows_out


def _run_batch_test(run_dir: Path, source: Source) -> dict | None:
    """The run's own last batch-test record for the analysed trainer (up to the analysed round)."""
    rounds, _ = _round_records(run_dir)
    for record in reversed(rounds):
        if source.round is not None and record.get("round", -1) > source.round:
            continue
        test = (record.get("batch_test") or {}).get(str(source.trainer))
        if test:
            return {"round": record.get("round"), **test}
    return None


def _finite(value: Any) -> Any:
    # JSON has no infinity: write it as the string "inf", as metrics.jsonl does.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_plots(out_dir: Path, deviations: dict[int, torch.Tensor], report: dict[str, Any]) -> list[Path]:
    """deviations.png (histograms of ‖g_B − g‖/‖g‖ per B) and deviation_vs_batch.png (measured vs predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("viridis")
    count = max(len(deviations) - 1, 1)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    positive = torch.cat([v[v > 0] for v in deviations.values()]).sqrt()
    if positive.numel():
        low, high = float(positive.min()), float(positive.max())
        bins = torch.logspace(math.log10(low) - 0.05, math.log10(high) + 0.05, 50).tolist()
        for index, (b, values) in enumerate(sorted(deviations.items())):
            norms = values[values > 0].sqrt()
            if not norms.numel():
                continue
            color = colors(index / count)
            axis.hist(norms.tolist(), bins=bins, histtype="step", color=color, label=f"B = {b}")
            row = next(r for r in report["batch_sizes"] if r["batch"] == b)
            axis.axvline(math.sqrt(row["predicted"]), color=color, linestyle=":", linewidth=1)
        axis.set_xscale("log")
    axis.set_xlabel("‖g_B − g‖ / ‖g‖ (dotted: predicted root-mean-square)")
    axis.set_ylabel(f"batches (of {report['batch_sizes'][0]['repeats']} per B)")
    axis.set_title(f"Batch-gradient deviation, {report['samples']} samples")
    axis.legend(fontsize=8)
    figure.tight_layout()
    histogram = out_dir / "deviations.png"
    figure.savefig(histogram, dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 4.5))
    table = [r for r in report["batch_sizes"] if r["predicted"] > 0 and r["measured"] > 0]
    batches = [r["batch"] for r in table]
    if table:
        errors = [r["measured_std_error"] or 0.0 for r in table]
        axis.errorbar(batches, [r["measured"] for r in table], yerr=errors, fmt="o", label="measured mean", zorder=3)
        axis.plot(batches, [r["predicted"] for r in table], "-", label="tr Cov (1 − B/N) / (B ‖g‖²)")
        axis.plot(batches, [r["predicted_with_replacement"] for r in table], "--", label="tr Cov / (B ‖g‖²), N = ∞")
    eta = report["norm_test"]["eta"]
    axis.axhline(eta * eta, color="grey", linestyle=":", label=f"norm test bound η² = {eta:g}²")
    if math.isfinite(report["noise_scale"]):
        axis.axvline(report["noise_scale"], color="red", linestyle=":", label=f"B_simple = {report['noise_scale']:.1f}")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("batch size B (samples)")
    axis.set_ylabel("E ‖g_B − g‖² / ‖g‖²")
    axis.set_title("Measured vs predicted batch-gradient deviation")
    axis.legend(fontsize=8)
    figure.tight_layout()
    curve = out_dir / "deviation_vs_batch.png"
    figure.savefig(curve, dpi=120)
    plt.close(figure)
    return [histogram, curve]


def print_report(report: dict[str, Any], console: Any) -> None:
    """The report as two rich tables: the statistics and the tests, then the deviation per batch size."""
    from rich.table import Table

    source = report["source"]
    where = "final model" if source["kind"] == "final" else f"checkpoint round {source['round']}"
    if source["trainer"] is not None:
        where += f", trainer {source['trainer']}"
    summary = Table(title=f"Gradient noise at the {where} ({report['samples']} samples × {report['context']} tokens)")
    summary.add_column("quantity")
    summary.add_column("value", justify="right")
    summary.add_row("‖g‖² (mean of the samples)", f"{report['grad_norm_sq']:.4g}")
    summary.add_row("‖∇F‖² unbiased (‖g‖² − tr Cov/N)", f"{report['unbiased_grad_norm_sq']:.4g}")
    summary.add_row("tr Cov (per-sample variance)", f"{report['trace_cov']:.4g}")
    summary.add_row("B_simple = tr Cov / ‖g‖²", f"{report['noise_scale']:.2f}")
    summary.add_row("B_simple with unbiased ‖∇F‖²", f"{report['noise_scale_unbiased']:.2f}")
    norm, inner = report["norm_test"], report["inner_product_test"]
    low, high = report["b_bounds"]
    summary.add_row(
        f"norm test, η = {norm['eta']:g}, M = {norm['workers']}",
        f"b = {norm['b_req']} (raw {norm['raw_request']:.2f}, clamped to {low}..{high})",
    )
    summary.add_row(
        f"inner-product test, ϑ = {inner['theta']:g}, ν = {inner['nu']:g}",
        f"b = {inner['b_req']} (ip {inner['ip_request']:.2f}, orth {inner['orth_request']:.2f})",
    )
    summary.add_row("b the run used there", "—" if report["run_batch"] is None else str(report["run_batch"]))
    test = report["run_batch_test"]
    if test:
        summary.add_row(
            f"run's own estimate (round {test['round']})",
            f"σ² {test['sample_variance']:.4g}, ‖∇F‖² {test['grad_norm_sq']:.4g}, raw {test['raw_request']:.2f}",
        )
    console.print(summary)
    table = Table(title="‖g_B − g‖² / ‖g‖² over random batches without replacement")
    for name in ("B", "measured mean", "± std. error", "predicted", "measured / predicted", "N = ∞ theory"):
        table.add_column(name, justify="right")
    for row in report["batch_sizes"]:
        table.add_row(
            str(row["batch"]),
            f"{row['measured']:.4g}",
            "—" if row["measured_std_error"] is None else f"{row['measured_std_error']:.2g}",
            f"{row['predicted']:.4g}",
            "—" if row["ratio"] is None else f"{row['ratio']:.3f}",
            f"{row['predicted_with_replacement']:.4g}",
        )
    console.print(table)
    for path in report["files"]:
        console.print(path, soft_wrap=True)
