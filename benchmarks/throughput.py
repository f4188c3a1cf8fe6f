"""Simulating many workers in one process: tokens/s of M workers of batch 3, one by one and stacked, against one
worker of batch 3·M (the same model, tokens per step and threads).

    python benchmarks/throughput.py --write             # measure; results/throughput.json, docs, plot
    python benchmarks/throughput.py --default-run --write   # also the default `adloco train`, before and after
    python benchmarks/throughput.py --report            # docs and plot again from the stored results
    python benchmarks/throughput.py --default-run --keep-cells --write   # only the default run, again

Runs go one at a time with two threads, in interleaved order (A B C A B C ...), and report the median of the
repeats' steady-state tokens/s (the first and last rounds of a run are left out: start-up and the final round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from common import ROOT, describe, environment, train_run
from link import publish

RESULTS = ROOT / "benchmarks" / "results" / "throughput.json"
IMAGE = ROOT / "docs" / "images" / "benchmarks" / "throughput.png"
DOC = ROOT / "docs" / "results" / "throughput.md"
BEGIN, END = "<!-- throughput:begin -->", "<!-- throughput:end -->"
THREADS = ["threads=2"]
QUIET = [
    "eval.every=100000",
    "eval.blocks=1",
    "eval.final_full=false",
    "checkpoint.every=100000",
    "run.save_final=false",
    "run.plots=false",
]
PER_WORKER = 3  # the anchor task's per-worker batch
ROUNDS = 8  # per run: enough for six steady-state rounds
TARGET = 0.9  # stacked M × 3 against one worker of 3·M


def cells(presets: list[str], counts: list[int]) -> dict[str, dict[str, list[str]]]:
    """For each (preset, worker count): one worker of the whole batch, then M workers one by one and stacked."""
    out = {}
    for preset in presets:
        for count in counts:
            common = [f"model.preset={preset}", "sync_every=10", f"total_tokens={_tokens(preset, count)}"]
            out[f"{preset} × {count}"] = {
                "one worker": [*common, "method=ddp", "workers=1", f"batch.size={PER_WORKER * count}"],
                "one by one": [*common, "method=diloco", f"workers={count}", "batched_workers=false"],
                "stacked": [*common, "method=diloco", f"workers={count}", "batched_workers=true"],
            }
    return out


def _tokens(preset: str, count: int) -> int:
    context = {"tiny": 64, "small": 128}[preset]
    return ROUNDS * 10 * PER_WORKER * count * context


def steady_tokens_per_second(metrics: Path) -> float:
    """Tokens over seconds of a run's rounds, without its first and last (a round record's tokens are the run's
    total so far)."""
    rounds = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "round"]
    if len(rounds) < 3:
        raise SystemExit(f"{metrics}: too few rounds to time")
    tokens = rounds[-2]["tokens"] - rounds[0]["tokens"]
    return tokens / sum(r["round_seconds"] for r in rounds[1:-1])


def measure(presets: list[str], counts: list[int], repeats: int) -> dict:
    """Every cell's runs, interleaved over the repeats; tokens/s per repeat and medians."""
    load_before = os.getloadavg()[0]
    table = cells(presets, counts)
    rates: dict[str, dict[str, list[float]]] = {cell: {label: [] for label in runs} for cell, runs in table.items()}
    for repeat in range(repeats):
        for cell, runs in table.items():
            for label, overrides in runs.items():
                with tempfile.TemporaryDirectory() as tmp:
                    train_run("run", [*overrides, *THREADS, *QUIET], Path(tmp))
                    rates[cell][label].append(steady_tokens_per_second(Path(tmp) / "run" / "metrics.jsonl"))
                print(f"  {repeat}: {cell} / {label}: {rates[cell][label][-1]:,.0f} tokens/s", flush=True)
    return {"environment": environment(load_before), "repeats": repeats, "rates": rates}


def default_run(repeats: int) -> dict:
    """`adloco train` with every default (seed 0, 1.536 M tokens), stacked and one by one, alternating."""
    seconds: dict[str, list[float]] = {"one by one": [], "stacked": []}
    losses: dict[str, list[float]] = {"one by one": [], "stacked": []}
    for _ in range(repeats):
        for label, flag in (("one by one", "false"), ("stacked", "true")):
            with tempfile.TemporaryDirectory() as tmp:
                summary = train_run("run", [f"batched_workers={flag}", "run.plots=false"], Path(tmp))
            seconds[label].append(summary["seconds"])
            losses[label].append(summary["val_loss"])
            print(f"  default run, {label}: {summary['seconds']:.1f} s, val loss {summary['val_loss']:.4f}", flush=True)
    return {"environment": environment(), "seconds": seconds, "val_loss": losses}


def _runs(count: int) -> str:
    return "one run each" if count == 1 else f"median of {count} runs each"


def _median(values: list[float]) -> float:
    return statistics.median(values)


def markdown(result: dict) -> list[str]:
    """The section of docs/results/benchmarks.md."""
    lines = [
        "## Throughput: many workers in one process",
        "",
        f"M workers of batch {PER_WORKER} (DiLoCo, H = 10) one by one and stacked (`batched_workers`), against one "
        f"worker of batch {PER_WORKER}·M: the same model, tokens per step and 2 threads, one run at a time in "
        f"interleaved order; steady-state tokens/s, median of {result['repeats']} repeats "
        f"(`python benchmarks/throughput.py --write`). Measured {describe(result['environment'])}.",
        "",
        "| preset × workers | one worker (tokens/s) | one by one | stacked | stacked / one worker "
        "| stacked / one by one |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cell, runs in result["rates"].items():
        single, alone, stacked = (_median(runs[k]) for k in ("one worker", "one by one", "stacked"))
        mark = "met" if stacked / single >= TARGET else "not met"
        lines.append(
            f"| {cell} | {single:,.0f} | {alone:,.0f} | {stacked:,.0f} | **{stacked / single:.2f}** ({mark}) "
            f"| {stacked / alone:.2f} |"
        )
    lines += ["", f"![tokens/s against worker count](../images/benchmarks/{IMAGE.name})", ""]
    default = result.get("default_run")
    if default:
        alone, stacked = _median(default["seconds"]["one by one"]), _median(default["seconds"]["stacked"])
        lines += [
            f"The default `adloco train` (DiLoCo, 4 workers × batch 3, 1.536 M tokens): {alone:.0f} s one by one, "
            f"{stacked:.0f} s stacked ({stacked / alone:.2f}×), final val loss "
            f"{_median(default['val_loss']['one by one']):.4f} and {_median(default['val_loss']['stacked']):.4f}; "
            f"{_runs(len(default['seconds']['stacked']))}, one after the other, {describe(default['environment'])}.",
            "",
        ]
    return lines


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(cell.split(" × ")[0] for cell in result["rates"]))
    figure, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 3.6), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        cells_of = {int(c.split(" × ")[1]): r for c, r in result["rates"].items() if c.startswith(f"{preset} ×")}
        counts = sorted(cells_of)
        for label in ("one worker", "one by one", "stacked"):
            ax.plot(counts, [_median(cells_of[m][label]) for m in counts], marker="o", label=label)
        ax.set(title=f"{preset}", xlabel="workers M (one worker: batch 3·M)", ylabel="tokens/s", xticks=counts)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(IMAGE, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--workers", default="4,8,16", help="worker counts (small: the first only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--default-run", action="store_true", help="also time the default `adloco train`")
    parser.add_argument("--write", action="store_true", help="store results/throughput.json, the docs and the plot")
    parser.add_argument("--report", action="store_true", help="only rewrite the docs and plot from the stored results")
    parser.add_argument("--keep-cells", action="store_true", help="keep the stored cells (with --default-run)")
    args = parser.parse_args()
    if args.report:
        result = json.loads(RESULTS.read_text())
        publish(result, "\n".join(markdown(result)), RESULTS, DOC, (BEGIN, END))
        plot(result)
        return
    counts = [int(x) for x in args.workers.split(",")]
    if args.keep_cells:
        result = json.loads(RESULTS.read_text())
    else:
        result = measure(["tiny"], counts, args.repeats) if "tiny" in args.presets else {"rates": {}}
        for preset in [p for p in args.presets.split(",") if p != "tiny"]:
            result["rates"].update(measure([preset], counts[:1], args.repeats)["rates"])
    result.setdefault("environment", environment())
    result.setdefault("repeats", args.repeats)
    if args.default_run:
        result["default_run"] = default_run(1)
    publish(result, "\n".join(markdown(result)), RESULTS, DOC if args.write else None, (BEGIN, END))
    if args.write:
        plot(result)


if __name__ == "__main__":
    main()
