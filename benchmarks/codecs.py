"""Val loss and bytes per codec for Streaming DiLoCo on the anchor task, at equal tokens.

    python benchmarks/codecs.py                      # full anchor budget (1.536 M tokens per run)
    python benchmarks/codecs.py --tokens 200000      # a quicker look

Runs go two at a time with one thread each (a 2-core machine); the table is printed as Markdown and
written to docs/results/codecs.md unless --no-write is given.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch
from common import ROOT, train_run

import adloco

CODECS = ["none", "bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0", "topk"]


def run(codec: str, tokens: int, root: Path, extra: list[str]) -> dict:
    overrides = ["method=streaming", f"codec.name={codec}", f"total_tokens={tokens}", "threads=1", *extra]
    summary = train_run(f"codec-{codec}", overrides, root)
    records = [json.loads(line) for line in (root / f"codec-{codec}" / "metrics.jsonl").read_text().splitlines()]
    peak = [r for r in records if r["kind"] == "round"][-1]["peak_sync_bytes"]
    return {"codec": codec, "val_loss": summary["val_loss"], "bytes": summary["bytes"], "peak_sync_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_536_000)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("extra", nargs="*", help="further overrides for every run, e.g. codec.error_feedback=true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: run(c, args.tokens, Path(tmp), args.extra), CODECS))
    base = results[0]
    lines = [
        "| codec | val loss | vs fp32 | bytes sent | fewer bytes than fp32 | peak bytes per sync |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {'fp32 (no codec)' if r['codec'] == 'none' else r['codec']} | {r['val_loss']:.4f} "
            f"| {100 * (r['val_loss'] / base['val_loss'] - 1):+.2f} % | {r['bytes'] / 1e6:,.1f} MB "
            f"| {base['bytes'] / r['bytes']:.2f}× | {r['peak_sync_bytes'] / 1e6:.2f} MB |"
        )
    table = "\n".join(lines)
    command = "python benchmarks/codecs.py" + (f" --tokens {args.tokens}" if args.tokens != 1_536_000 else "")
    command += "".join(f" {e}" for e in args.extra)
    header = (
        f"Measured {date.today().isoformat()} with `{command}`: adloco {adloco.__version__}, "
        f"torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()} CPU. Streaming DiLoCo (4 workers × batch 3, "
        f"H = 10, P = 2 fragments, τ = 1, α = 0.5), {args.tokens:,} training tokens per run, seed 0; "
        "val loss over the whole validation split."
    )
    print(header + "\n\n" + table)
    if not args.no_write:
        doc = ROOT / "docs" / "results" / "codecs.md"
        doc.write_text("# Codecs on the anchor task\n\n" + header + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
