"""How soon `adloco train` says what is wrong with its input: the wall time of each bad-input error, in a fresh
process as a user meets it.

    python benchmarks/early_errors.py --label after                    # this tree
    python benchmarks/early_errors.py --label before --src OTHER/src   # another checkout's sources, to compare
    python benchmarks/early_errors.py --write                          # the table in docs/reliability.md

Each case runs ``--repeats`` times (median), one process at a time; every one must end with exit code 2 and one
line. Results: benchmarks/results/early_errors.json, under the label.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import ROOT, environment

RESULTS = ROOT / "benchmarks" / "results" / "early_errors.json"
DOC = ROOT / "docs" / "reliability.md"
MARKERS = ("<!-- early-errors:begin -->", "<!-- early-errors:end -->")


def cases(folder: Path) -> dict[str, list[str]]:
    """Bad inputs, each as the overrides of a command line."""
    (folder / "empty.txt").write_bytes(b"")
    (folder / "blob.txt").write_bytes(b"\x00\x01" * 100)
    (folder / "short.txt").write_text("too short")
    (folder / "rows.jsonl").write_text("{not json\n")
    (folder / "shards").mkdir(exist_ok=True)
    np.arange(1000, dtype=np.uint16).tofile(folder / "shards" / "a.bin")
    started = folder / "started"  # a run directory whose run stopped before its first checkpoint
    (started / "checkpoints").mkdir(parents=True, exist_ok=True)
    config = subprocess.run(
        [sys.executable, "-m", "adloco", "train", "--print-config=all"], capture_output=True, text=True
    )
    (started / "config.yaml").write_text(config.stdout)
    return {
        "a data file that does not exist": [f"data.dataset={folder / 'nope.txt'}"],
        "an empty data file": [f"data.dataset={folder / 'empty.txt'}"],
        "a binary data file": [f"data.dataset={folder / 'blob.txt'}"],
        "a split shorter than one context": [f"data.dataset={folder / 'short.txt'}"],
        "a JSON Lines file that is not JSON": [f"data.dataset={folder / 'rows.jsonl'}"],
        "a folder of shards without a manifest": [f"data.dataset={folder / 'shards'}"],
        "shards=2 in one process": ["shards=2"],
        "workers that do not fill the slots": ["workers=3", "slots_per_rank=2"],
        "run.root under a file": [f"run.root={folder / 'empty.txt' / 'runs'}"],
        "--resume of a run without a checkpoint": ["--resume", str(started)],
        "--resume with a setting that cannot change": ["--resume", str(started), "model.context=32"],
    }


def time_case(overrides: list[str], src: Path | None, root: Path) -> float:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    if not any(o.startswith(("run.root=", "--resume")) for o in overrides):
        overrides = [*overrides, f"run.root={root}"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "adloco", "train", *overrides],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 2 or done.stderr.strip().count("\n"):
        raise RuntimeError(f"{overrides}: exit {done.returncode}, {done.stderr.strip()[:300]}")
    return seconds


def render(results: dict) -> str:
    labels = [label for label in ("before", "after") if label in results]
    lines = ["| bad input | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for name in results[labels[-1]]["seconds"]:
        cells = [f"{results[label]['seconds'].get(name, float('nan')):.2f} s" for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    env = results[labels[-1]]["environment"]
    lines += ["", f"Medians of {results[labels[-1]]['repeats']} runs each, {env['date']}, one at a time on an idle "
              f"2-core machine (Python {env['python']}, torch {env['torch']})."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", choices=["before", "after"], default=None)
    parser.add_argument("--src", type=Path, default=None, help="a checkout's src folder to time instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if args.label:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch)
            seconds = {
                name: statistics.median(time_case(o, args.src, folder / "runs") for _ in range(args.repeats))
                for name, o in cases(folder).items()
            }
        results[args.label] = {"seconds": seconds, "repeats": args.repeats, "environment": environment()}
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    text = render(results)
    print(text)
    if args.write:
        from link import write_between

        write_between(DOC, *MARKERS, text)


if __name__ == "__main__":
    main()
