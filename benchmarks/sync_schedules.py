"""H schedules other than the rule's: could any shape of H over a run beat the best fixed H by more than the rule?

    python benchmarks/sync_schedules.py --write                      # 6 schedules x 3 seeds, about 18 minutes
    python benchmarks/sync_schedules.py --seeds 0 --schedules rule,steeper

The tokens a run needs to a target do not depend on where its workers run (one process or ranks over a link, the
same tokens to the token), so each schedule trains in one process and only its time is priced from a link cell of
benchmarks/auto_sync.py: the medians of the cell's fixed H give the seconds per 1,000 tokens τ and per exchange c
(time = τ·tokens + c·exchanges, least squares over the fixed H that reached the target), and a schedule's time to
the target is τ times its tokens plus c times the rounds it exchanged up to the evaluation that crossed the
target. ``sync_every=auto`` runs with the cell's t and c pinned (``batch.time.step_seconds`` and ``round_seconds``),
so its H path is the config's alone; the schedules differ in ``sync_auto.lr_power`` and ``sync_auto.drift_steps``:

- ``rule``: the default (H_d = 400, H* ∝ sqrt(peak lr / lr));
- ``steeper`` and ``steepest``: short rounds early that grow as peak/lr and (peak/lr)^1.5 (QSR grows H faster
  still, as (peak/lr)^2, which the bound of 200 would cut off here);
- ``shrinking``: long rounds early that shorten as sqrt(lr / peak lr), as AdaComm's loss term would;
- ``drift-200`` and ``drift-100``: the rule with a smaller drift scale (shorter rounds throughout);
- ``h20``, ``h50`` and ``h100``: fixed H.

Every run is stopped at the target. Writes benchmarks/results/sync_schedules.json and, with ``--write``, the
table between its markers in docs/results/auto-sync.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import link
import torch
from auto_sync import RESULTS as LINK_RESULTS
from auto_sync import interpolated_time, median_time

ROOT = link.ROOT
DOC = ROOT / "docs" / "results" / "auto-sync.md"
RESULTS = ROOT / "benchmarks" / "results" / "sync_schedules.json"
MARKERS = ("<!-- sync-schedules:begin -->", "<!-- sync-schedules:end -->")
SCHEDULES = {
    "rule": ["sync_every=auto"],
    "steeper": ["sync_every=auto", "sync_auto.lr_power=2", "sync_auto.drift_steps=100"],
    "steepest": ["sync_every=auto", "sync_auto.lr_power=3", "sync_auto.drift_steps=100"],
    "shrinking": ["sync_every=auto", "sync_auto.lr_power=-1", "sync_auto.drift_steps=1600"],
    "drift-200": ["sync_every=auto", "sync_auto.drift_steps=200"],
    "drift-100": ["sync_every=auto", "sync_auto.drift_steps=100"],
    "h20": ["sync_every=20"],
    "h50": ["sync_every=50"],
    "h100": ["sync_every=100"],
}
RUN_TIMEOUT_S = 1800
BATCH, CONTEXT = 3, 64  # the default per-worker batch and context: tokens per worker and inner step


def fitted_costs(cell: dict[str, Any]) -> tuple[float, float]:
    """(τ seconds per 1,000 tokens, c seconds per exchange), least squares through the medians of the link cell's
    fixed H that reached its target (seconds = τ·tokens/1000 + c·exchanges)."""
    tokens_per_step = cell["ranks"] * BATCH * CONTEXT
    points = []
    for method, runs in cell["runs"].items():
        if method.startswith("diloco-h"):
            seconds, tokens = median_time(runs), median_time(runs, "tokens_to_target")
            h = int(method.removeprefix("diloco-h"))
            if seconds is not None and tokens is not None:
                points.append((tokens / 1000, tokens / (h * tokens_per_step), seconds))
    if len(points) < 2:
        raise SystemExit("fewer than two fixed H reached the cell's target: no costs to fit")
    costs = torch.tensor([(k, e) for k, e, _ in points], dtype=torch.float64)
    seconds = torch.tensor([[s] for *_, s in points], dtype=torch.float64)
    tau, exchange = torch.linalg.lstsq(costs, seconds).solution.flatten().tolist()
    return tau, exchange


def train_to_target(name: str, settings: list[str], target: float, out: Path) -> list[dict[str, Any]]:
    """One ``adloco train`` in one process, stopped once an evaluation reaches ``target``; its round records."""
    command = [sys.executable, "-m", "adloco", "train", *settings, f"run.root={out}", f"run.name={name}"]
    shutil.rmtree(out / name, ignore_errors=True)  # a run of an earlier invocation would be resumed
    tail = link.MetricsTail(out / name / "metrics.jsonl")  # read as it grows, not again from its start
    log = out / f"{name}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} ran past {RUN_TIMEOUT_S} s; see {log}")
                time.sleep(0.5)
                if interpolated_time(tail.poll(), target) is not None:
                    proc.kill()
                    break
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {log}")
    return [r for r in tail.poll() if r["kind"] == "round"]


def summary(rounds: list[dict[str, Any]], target: float, tau: float, exchange: float) -> dict[str, Any]:
    """Tokens and exchanges to the target and the priced time; an unfinished run counts as endless."""
    hit = interpolated_time(rounds, target)
    h = [int(r["sync_every"]) for r in rounds]
    if hit is None:
        return {"tokens": None, "exchanges": None, "seconds": None, "h": h}
    tokens = hit[1]
    exchanges = next(i + 1 for i, r in enumerate(rounds) if r["tokens"] >= tokens)
    return {"tokens": tokens, "exchanges": exchanges, "seconds": tau * tokens / 1000 + exchange * exchanges, "h": h}


def measure(args: argparse.Namespace, report: dict[str, Any], command: str) -> None:
    """Every schedule at every seed on the cell's target and budget; the cell's entry in ``report``."""
    cells = json.loads(args.link_results.read_text())["cells"]
    if args.cell not in cells:
        raise SystemExit(f"no cell {args.cell!r} in {args.link_results}; it has {', '.join(cells)}")
    cell = cells[args.cell]
    tau, exchange = fitted_costs(cell)
    step_seconds = cell["ranks"] * BATCH * CONTEXT * tau / 1000  # a link rank's seconds per inner step
    # in one process every worker is on one rank, whose step time is the sum of its workers'
    pinned = [
        f"batch.time.step_seconds=[{step_seconds / cell['ranks']:.6g},0]",
        f"batch.time.round_seconds={exchange:.6g}",
    ]
    entry = report.setdefault("cells", {}).setdefault(args.cell, {})
    entry.update(target=cell["target"], tokens=cell["tokens"], workers=cell["ranks"], tau=tau, exchange=exchange,
                 date=date.today().isoformat(), machine=link.machine(), command=command)  # fmt: skip
    runs = entry.setdefault("runs", {})
    # every round evaluated as in the link cells; two threads in one process need the tokens one thread per rank does
    common = [s for s in link.COMMON if not s.startswith(("eval.every=", "threads="))]
    for seed in args.seeds:
        for schedule in args.schedules:
            settings = [*common, "eval.every=1", "method=diloco", f"workers={cell['ranks']}",
                        f"total_tokens={cell['tokens']}", f"seed={seed}", "threads=2", *pinned,
                        *SCHEDULES[schedule]]  # fmt: skip
            name = f"{args.cell.replace('/', '-')}-{schedule}-s{seed}"
            print(f"  {name} ...", flush=True)
            rounds = train_to_target(name, settings, cell["target"], args.out)
            result = {"seed": seed, **summary(rounds, cell["target"], tau, exchange)}
            kept = [r for r in runs.get(schedule, []) if r["seed"] != seed]  # a seed measured again replaces its run
            runs[schedule] = sorted([*kept, result], key=lambda r: r["seed"])
            print(f"  {name}: {result['tokens']} tokens, {result['exchanges']} exchanges", flush=True)
            RESULTS.write_text(json.dumps(report, indent=2) + "\n")


def cell_table(key: str, entry: dict[str, Any]) -> str:
    """One cell's schedules: tokens, exchanges and priced time to the target, each against the best fixed H."""
    runs = entry["runs"]
    fixed = {s: median_time(runs[s], "seconds") for s in ("h20", "h50", "h100") if s in runs}
    best = min((s for s in fixed if fixed[s] is not None), key=fixed.get, default=None)
    seeds = sorted({r["seed"] for seeds in runs.values() for r in seeds})
    lines = [
        f"**{key}**, {entry['workers']} workers in one process, target {entry['target']}, budget "
        f"{entry['tokens']:,} tokens, seeds {', '.join(map(str, seeds))}; priced at τ = {entry['tau']:.4f} s per "
        f"1,000 tokens and c = {entry['exchange']:.3f} s per exchange (measured {entry['date']} with "
        f"`{entry['command']}`)",
        "",
        "| schedule | tokens to target (median) | each seed | exchanges (median) | priced time (median) | "
        "against the best fixed H | H over the first seed's rounds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for schedule, seeds in runs.items():
        seconds = median_time(seeds, "seconds")
        ratio = "—" if best is None or seconds is None else f"{seconds / fixed[best]:.2f}×"
        each = ", ".join("—" if r["tokens"] is None else f"{r['tokens'] / 1000:.0f}k" for r in seeds)
        tokens, exchanges = median_time(seeds, "tokens"), median_time(seeds, "exchanges")
        h = seeds[0]["h"]
        lines.append(
            f"| {schedule} | {'—' if tokens is None else f'{tokens:,.0f}'} | {each} | "
            f"{'—' if exchanges is None else f'{exchanges:g}'} | {'—' if seconds is None else f'{seconds:.1f} s'} | "
            f"{ratio} | {', '.join(map(str, h[:3]))} … {h[-1]} |"
        )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """Every measured cell's table."""
    return "\n\n".join(cell_table(key, entry) for key, entry in report.get("cells", {}).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="shakespeare/2r/100mbit", help="the link cell whose target and costs count")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--schedules", default="rule,steeper,steepest,shrinking,h50,h100")
    parser.add_argument("--link-results", type=Path, default=LINK_RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "sync_schedules")
    parser.add_argument("--write", action="store_true", help="put the table into docs/results/auto-sync.md")
    parser.add_argument("--render", action="store_true", help="only render the stored results")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = sorted(set(args.schedules) - set(SCHEDULES))
    if unknown or not args.schedules:
        parser.error(f"--schedules: choose from {', '.join(SCHEDULES)}")
    if not args.render and not args.link_results.exists():
        parser.error(f"--link-results: {args.link_results} does not exist (run benchmarks/auto_sync.py first)")
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.render:
        given = argv if argv is not None else sys.argv[1:]
        command = shlex.join(["python", "benchmarks/sync_schedules.py", *given])
        args.out.mkdir(parents=True, exist_ok=True)
        measure(args, report, command)
    text = markdown(report)
    print(text)
    if args.write:
        link.write_between(DOC, *MARKERS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
