"""Sharded workers (``shards=S``): memory and bytes per rank against unsharded workers, and the same training.

    python benchmarks/sharding.py [--preset micro-llama-300m] [--write]

Runs DiLoCo with 2 workers under torchrun, one process per rank, once unsharded (2 ranks) and once with each worker
sharded over 2 ranks (4 ranks), both with sharded checkpoints, and once unsharded with the tiny model for the
memory a rank needs without a model to speak of (torch, the data, the run). Reports per rank the resident memory
at the end of the last round and its peak over the run, the bytes it handed to the backend in a round, and both
runs' final validation loss; beside them, what adloco's memory preflight estimates for a rank of each layout, and
its estimate for the ``llama-1b`` preset at S = 1, 2, 4 and 8. With ``--write`` the figures go to
``benchmarks/results/sharding.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import environment, free_port

from adloco.metrics.writer import read_metrics
from adloco.models.build import PRESETS, build_model, preset_config
from adloco.run.preflight import estimate_memory

RESULTS = Path(__file__).parent / "results" / "sharding.json"
RUN = ["method=diloco", "workers=2", "sync_every=2", "batch.size=2", "threads=1", "checkpoint.format=sharded",
       "eval.every=1000", "eval.blocks=2", "eval.final_full=false", "run.save_final=false", "run.plots=false",
       "run.progress=false"]  # fmt: skip
_BYTE_VOCAB = 256


def _run(shards: int, preset: str, context: int, root: Path) -> dict:
    """One torchrun job of 2 workers × ``shards`` ranks; its last round's per-rank figures and final loss."""
    tokens = 2 * 2 * 2 * 2 * context  # workers × batch × H × 2 rounds × context
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={2 * shards}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "adloco", "train", *RUN, f"model.preset={preset}",
        f"model.context={context}", f"total_tokens={tokens}", f"shards={shards}", f"run.root={root}",
        f"run.name=shards_{shards}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3000)
    if done.returncode != 0:
        raise SystemExit(f"shards={shards} failed:\n{done.stderr[-3000:]}")
    records = read_metrics(root / f"shards_{shards}" / "metrics.jsonl")
    last = [r for r in records if r["kind"] == "round"][-1]
    final = next(r for r in records if r["kind"] == "final")
    return {
        "shards": shards,
        "ranks": 2 * shards,
        "rss_mib": [m["rss_mib"] for m in last["memory"]],
        "peak_rss_mib": [m["peak_rss_mib"] for m in last["memory"]],
        "wire_bytes_per_round": [r["wire_bytes"] for r in last["ranks"]],
        "val_loss": final["val_loss"]["0"],
    }


def _estimate_mib(preset: str, context: int, batch: int, shards: int, trainers: int = 1) -> float:
    """The preflight's estimate for a rank hosting one worker's shard and a trainer's θ rows."""
    config = preset_config(preset, _BYTE_VOCAB, context)
    layers, _, _, hidden, _, _ = PRESETS[preset]
    with torch.device("meta"):  # only the parameter count is read
        parameters = sum(p.numel() for p in build_model(config, 0).parameters())
    estimate = estimate_memory(parameters, 1, trainers, batch, context, hidden, layers, shards)
    return estimate.total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="micro-llama-300m")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        runs = [_run(shards, args.preset, args.context, Path(root)) for shards in (1, 2)]
        baseline = _run(1, "tiny", args.context, Path(root) / "baseline")  # the process without a model to speak of
    floor = max(baseline["peak_rss_mib"])
    print(f"baseline (tiny model, 2 ranks): peak {baseline['peak_rss_mib']} MiB per rank")
    for run in runs:
        run["peak_above_baseline_mib"] = [round(m - floor, 1) for m in run["peak_rss_mib"]]
        run["estimate_mib"] = round(_estimate_mib(args.preset, args.context, 2, run["shards"]), 1)
        print(
            f"shards={run['shards']} ({run['ranks']} ranks): rss at the end {run['rss_mib']} MiB, peak "
            f"{run['peak_rss_mib']} MiB ({run['peak_above_baseline_mib']} above the baseline), preflight estimate "
            f"{run['estimate_mib']} MiB per rank (state only); "
            f"wire bytes per round {run['wire_bytes_per_round']}; val loss {run['val_loss']:.4f}"
        )
    billion = {s: round(_estimate_mib("llama-1b", 2048, 4, s) / 1024, 1) for s in (1, 2, 4, 8)}
    print(f"llama-1b, context 2048, micro-batch 4, one worker's shard and θ's rows per rank (GiB): {billion}")
    result = {
        "preset": args.preset,
        "context": args.context,
        "runs": runs,
        "baseline_peak_rss_mib": baseline["peak_rss_mib"],
        "llama_1b_estimate_gib": billion,
    }
    if args.write:
        RESULTS.write_text(json.dumps({**result, "environment": environment()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
