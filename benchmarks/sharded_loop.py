"""A worker sharded with FSDP2 in a user's own loop (examples/sharded_loop.py): bytes and memory per rank against
unsharded workers, and the same training.

    python benchmarks/sharded_loop.py [--hidden 512 --layers 8 --steps 20] [--write]

Runs the example's DiLoCo loop with 2 workers under torchrun, one thread per rank: once with each worker on one
rank (2 ranks), once with each sharded over 2 ranks (4 ranks), and once with a model of almost nothing for the
memory a rank needs without one (torch, transformers, the data). Reports the largest per-rank figures: bytes handed
to the backend per round, peak resident memory, and the final loss of each. With ``--write`` the figures go to
``benchmarks/results/sharded_loop.json`` and the table between the markers in docs/own-loop.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess

from common import ROOT, environment, torchrun

EXAMPLE = ROOT / "examples" / "sharded_loop.py"
RESULTS = ROOT / "benchmarks" / "results" / "sharded_loop.json"
DOC = ROOT / "docs" / "own-loop.md"
MARKERS = ("<!-- sharded-loop:begin -->", "<!-- sharded-loop:end -->")
LINE = re.compile(r"loss (\d+\.\d+); per rank ([\d,]+) bytes a round, peak memory ([\d,]+) MB")


def run(shards: int, hidden: int, layers: int, steps: int) -> dict:
    """One torchrun job of 2 workers × ``shards`` ranks; the example's last line parsed."""
    command, env = torchrun(2 * shards)
    command += [str(EXAMPLE), "--shards", str(shards), "--hidden", str(hidden), "--layers", str(layers), "--steps",
                str(steps)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3000)
    match = LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"shards={shards} failed:\n{done.stderr[-3000:]}")
    loss, sent, peak = (float(g.replace(",", "")) for g in match.groups())
    return {"shards": shards, "hidden": hidden, "layers": layers, "loss": loss, "bytes_per_round": sent,
            "peak_mb": peak}  # fmt: skip


def table(report: dict) -> str:
    floor = report["floor"]["peak_mb"]
    whole, sharded = report["runs"]
    env = report["environment"]
    rows = [
        f"Measured {env['date']} with `{report['command']}`: adloco {env['adloco']}, torch {env['torch']}, "
        f"{env['machine']}; 2 workers, a byte-level LLaMA of width {whole['hidden']} and {whole['layers']} layers, "
        f"{report['steps']} steps of 4 samples × 64 tokens per worker, H = 10, one thread per rank; the largest "
        f"figure over the ranks. Floor: a rank with a model of almost nothing peaks at {floor:,.0f} MB.",
        "",
        "| ranks per worker | bytes per rank per round | peak memory per rank | above the floor | final loss |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in (whole, sharded):
        rows.append(f"| {run['shards']} | {run['bytes_per_round']:,.0f} | {run['peak_mb']:,.0f} MB | "
                    f"{run['peak_mb'] - floor:,.0f} MB | {run['loss']:.4f} |")  # fmt: skip
    ratio = (sharded["peak_mb"] - floor) / (whole["peak_mb"] - floor)
    rows += ["", f"Sharded over 2 ranks: {sharded['bytes_per_round'] / whole['bytes_per_round']:.2f}× the bytes "
             f"per rank, {ratio:.2f}× the memory above the floor, the same loss to four decimals."]  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    floor = run(1, 32, 1, args.steps)
    runs = [run(shards, args.hidden, args.layers, args.steps) for shards in (1, 2)]
    command = "python benchmarks/sharded_loop.py" + (" --write" if args.write else "")
    report = {"command": command, "steps": args.steps, "floor": floor, "runs": runs, "environment": environment()}
    print(table(report))
    if args.write:
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        text = DOC.read_text()
        start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
        DOC.write_text(text[:start] + "\n" + table(report) + "\n" + text[end:])


if __name__ == "__main__":
    main()
