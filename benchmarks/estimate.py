"""Predicted vs measured rounds to a target loss (``adloco estimate``) on the anchor task.

    python benchmarks/estimate.py                          # train the runs below, then compare
    python benchmarks/estimate.py --run-dir runs/a --run-dir runs/b   # reuse finished runs
    python benchmarks/estimate.py --tokens 400000          # a quicker look

Each run is calibrated on its first 20 % of rounds (``--share``); the targets are the training losses the
run itself reached at 30, 50, 75 and 100 % of its rounds (best so far, rounded up to 0.01, so each was
reached), unless ``--targets`` gives them. The Markdown table is printed and, with ``--write``, put into
docs/estimate.md between the benchmark markers. The figures there used ``--tokens 512000``.
"""

from __future__ import annotations

import argparse
import math
import platform
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch

import adloco
from adloco.config import ConfigError
from adloco.config.input import layered
from adloco.data import DataError
from adloco.tools.estimate import MIN_CALIBRATION, estimate, load_rounds

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "estimate.md"
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"

# Runs with batch-test statistics: the default DiLoCo with b held at 3 (the test runs, b cannot move), DiLoCo
# whose b follows a gentler norm test (at the default η = 0.8 the batch grows so fast that few rounds are left
# to predict at a reduced budget), and AdLoCo with its defaults and with that gentler test.
GENTLE = ["batch.statistics.eta=2.5", "batch.statistics.ema=0.5"]
RUNS = {
    "diloco-b3": ["method=diloco", "batch.test=norm", "batch.b_min=3", "batch.b_cap=3"],
    "diloco-norm": ["method=diloco", "batch.test=norm", *GENTLE],
    "adloco": ["method=adloco"],
    "adloco-gentle": ["method=adloco", *GENTLE],
}
FRACTIONS = (0.3, 0.5, 0.75, 1.0)


def train(name: str, overrides: list[str], root: Path, tokens: int, threads: int, extra: list[str]) -> Path:
    """Train one run in a subprocess (its own torch threads) and return its run directory."""
    settings = [f"total_tokens={tokens}", f"threads={threads}", "run.progress=false", "run.plots=false"]
    settings += [f"run.root={root}", f"run.name={name}"]
    shutil.rmtree(root / name, ignore_errors=True)  # an earlier invocation's run of the same name
    command = [sys.executable, "-m", "adloco", "train", *layered(overrides, settings, extra)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return root / name


def _run_summary(run_dir: Path) -> str:
    """The settings that matter for the comparison, read back from the run's own config."""
    config, _, _ = load_rounds(run_dir)
    batch = config.batch
    test = f"b fixed at {batch.size}" if batch.b_min == batch.b_cap else f"norm test η = {batch.statistics.eta:g}"
    if batch.statistics.ema:
        test += f", EMA {batch.statistics.ema:g}"
    trainers = f"{config.trainers} trainer{'s' if config.trainers > 1 else ''}"
    workers = f"{config.workers} worker{'s' if config.workers > 1 else ''}"
    return f"{config.method}, {trainers} of {workers}, {test}, {config.total_tokens:,} tokens"


def trainer_losses(run_dir: Path) -> list[float]:
    """Training loss per round of the trainer ``adloco estimate`` follows by default (the final best)."""
    _, rounds, best = load_rounds(run_dir)
    trainer = str(best if best is not None else 0)
    return [r["train_loss"][trainer] for r in rounds if trainer in (r.get("train_loss") or {})]


def auto_targets(losses: list[float]) -> list[float]:
    """Training losses the run reached at FRACTIONS of its rounds, rounded up to 0.01."""
    best_so_far = [min(losses[: i + 1]) for i in range(len(losses))]
    targets = {math.ceil(best_so_far[max(0, math.ceil(f * len(losses)) - 1)] * 100) / 100 for f in FRACTIONS}
    return sorted(targets, reverse=True)


def rows(run_dir: Path, targets: list[float] | None, share: float) -> tuple[list[str], list[float]]:
    """Table rows for one run and the relative errors of its predictions."""
    losses = trainer_losses(run_dir)
    calibrate = max(MIN_CALIBRATION, round(share * len(losses)))
    out, errors = [], []
    for target in targets or auto_targets(losses):
        try:
            result = estimate(run_dir, target, calibrate)
        except (ConfigError, DataError) as error:
            out.append(f"| {run_dir.name} | {calibrate} of {len(losses)} | — | {target:.2f} | {error} | — | — |")
            continue
        pred, meas, cal = result["prediction"], result["measured"], result["calibration"]
        if pred.get("during_calibration"):
            predicted = "reached in calibration"
        elif pred["reachable"]:
            predicted = f"{pred['rounds']} ({pred['tokens'] / 1e6:.3f} M tok, b {pred['final_batch']})"
        else:
            predicted = f"not reached ({pred['reason']})"
        measured = f"{meas['rounds']} ({meas['tokens'] / 1e6:.3f} M tok)" if meas else "not reached"
        error = "—"
        if result["relative_error"] is not None:
            errors.append(result["relative_error"])
            error = f"{result['relative_error']:+.0%}"
        out.append(
            f"| {run_dir.name} | {cal['rounds']} of {result['rounds_in_run']} | {cal['loss_end']:.3f} "
            f"| {target:.2f} | {predicted} | {measured} | {error} |"
        )
    return out, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", action="append", type=Path, default=[], help="reuse a finished run (repeat)")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "estimate-benchmark", help="where runs go")
    parser.add_argument("--tokens", type=int, default=1_536_000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--share", type=float, default=0.2, help="share of rounds to calibrate on")
    parser.add_argument("--targets", default=None, help="comma-separated training losses (default: from the run)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/estimate.md")
    parser.add_argument("extra", nargs="*", help="further overrides for every run")
    args = parser.parse_args()
    run_dirs = list(args.run_dir)
    if not run_dirs:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            run_dirs = list(
                pool.map(
                    lambda item: train(item[0], item[1], args.root, args.tokens, args.threads, args.extra),
                    RUNS.items(),
                )
            )
    lines = [
        "| run | calibration rounds | loss after calibration | target | predicted rounds | measured rounds | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary = []
    for run_dir in run_dirs:
        targets = [float(t) for t in args.targets.split(",")] if args.targets else None
        run_rows, errors = rows(run_dir, targets, args.share)
        lines.extend(run_rows)
        if errors:
            summary.append(
                f"{run_dir.name} {statistics.median(abs(e) for e in errors):.0%} "
                f"({sum(e < 0 for e in errors)} early, {sum(e > 0 for e in errors)} late)"
            )
    table = "\n".join(lines)
    if summary:
        table += "\n\nMedian |error| per run: " + "; ".join(summary) + "."
    command = " ".join(["python benchmarks/estimate.py", *sys.argv[1:]])
    runs = "; ".join(f"{d.name}: {_run_summary(d)}" for d in run_dirs)
    header = (
        f"Measured {date.today().isoformat()} with `{command}`: adloco {adloco.__version__}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} CPU "
        f"({torch.get_num_threads()} threads available). Runs ({runs}). Losses are the followed trainer's mean "
        "training loss per round (nats per character); error = (predicted − measured) / measured rounds."
    )
    print(header + "\n\n" + table)
    if args.write:
        text = DOC.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOC.write_text(text[:start] + "\n" + header + "\n\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    main()
