"""What adloco.DiLoCo costs and gives in a user's own loop: examples/plain_loop.py with DiLoCo against the same
loop under torch DDP, and examples/adaptive_loop.py (AdLoCo's adaptive batch, time-aware and norm-test
controllers) on the same token budget; 2 torchrun ranks of one thread each on this machine, runs alternating.

    python benchmarks/own_loop.py                       # 3 runs of each, 400 steps (153,600 tokens)
    python benchmarks/own_loop.py --repeats 1 --steps 40

Reports the median tokens/s and validation loss (64 blocks of the held-out tail) of each, and their ratio;
writes benchmarks/results/own_loop.json and the table between the markers in docs/own-loop.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

from common import ROOT, environment, torchrun
from link import publish

EXAMPLE = ROOT / "examples" / "plain_loop.py"
ADAPTIVE = ROOT / "examples" / "adaptive_loop.py"
MODES = ("diloco", "ddp", "adloco-time", "adloco-test")
DOC = ROOT / "docs" / "own-loop.md"
MARKERS = ("<!-- own-loop:begin -->", "<!-- own-loop:end -->")
LINE = re.compile(r"(\w+): val loss (\d+\.\d+), ([\d,]+) tokens/s(?:, b \d+ -> (\d+))?")


def run(mode: str, steps: int, sync_every: int) -> dict:
    """One torchrun job of the example; its final line parsed."""
    command, env = torchrun(2)
    if mode.startswith("adloco"):
        command += [str(ADAPTIVE), "--tokens", str(steps * 2 * 3 * 64), "--controller", mode.split("-")[1]]
    else:
        command += [str(EXAMPLE), "--steps", str(steps), *(["--ddp"] if mode == "ddp" else [])]
    command += ["--sync-every", str(sync_every)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    match = LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"{mode} failed: {done.stderr[-2000:]}")
    return {
        "mode": mode,
        "val_loss": float(match.group(2)),
        "tokens_per_second": float(match.group(3).replace(",", "")),
        "final_batch": int(match.group(4)) if match.group(4) else 3,
    }


def table(report: dict) -> str:
    rows = [
        "| loop | val loss (median) | tokens/s (median) | b at the end | runs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        runs = [r for r in report["runs"] if r["mode"] == mode]
        if not runs:
            continue
        loss = statistics.median(r["val_loss"] for r in runs)
        speed = statistics.median(r["tokens_per_second"] for r in runs)
        batch = "/".join(str(b) for b in sorted({r.get("final_batch", 3) for r in runs}))
        rows.append(f"| {mode} | {loss:.4f} | {speed:,.0f} | {batch} | {len(runs)} |")
    env = report["environment"]
    return "\n".join([
        f"Measured {env['date']} with `{report['command']}`: adloco {env['adloco']}, torch {env['torch']}, Python "
        f"{env['python']}, {env['machine']}; {report['steps']} steps of 2 ranks × batch 3 × 64 tokens "
        f"({report['tokens']:,} tokens), H = {report['sync_every']}, one thread per rank, runs alternating; the "
        "adloco loops start at b = 3 and read the same tokens in as many steps as their batches make.",
        "",
        *rows,
        "",
        f"DiLoCo/DDP: {report['speed_ratio']:.2f}× the tokens/s, validation loss {report['loss_change']:+.1%}. "
        + " ".join(f"{m}/DiLoCo: {v['speed_ratio']:.2f}× the tokens/s, validation loss {v['loss_change']:+.1%}."
                   for m, v in report.get("adloco_vs_diloco", {}).items()),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="store the results and update docs/own-loop.md")
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            runs.append(run(mode, args.steps, args.sync_every))
            print(f"  {runs[-1]}", flush=True)
    median = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m) for k in ("val_loss", "tokens_per_second")}
              for m in MODES}  # fmt: skip
    report = {
        "command": "python benchmarks/own_loop.py" + "".join(f" {a}" for a in sys.argv[1:] if a != "--write"),
        "environment": environment(),
        "steps": args.steps,
        "sync_every": args.sync_every,
        "tokens": args.steps * 2 * 3 * 64,
        "runs": runs,
        "speed_ratio": median["diloco"]["tokens_per_second"] / median["ddp"]["tokens_per_second"],
        "loss_change": median["diloco"]["val_loss"] / median["ddp"]["val_loss"] - 1,
        "adloco_vs_diloco": {
            m: {
                "speed_ratio": median[m]["tokens_per_second"] / median["diloco"]["tokens_per_second"],
                "loss_change": median[m]["val_loss"] / median["diloco"]["val_loss"] - 1,
            }
            for m in MODES
            if m.startswith("adloco")
        },
    }
    text = table(report)
    if args.write:
        publish(report, text, ROOT / "benchmarks" / "results" / "own_loop.json", DOC, MARKERS)
    else:
        print(text)


if __name__ == "__main__":
    main()
