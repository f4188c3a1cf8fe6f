"""Shared by the benchmark scripts: run `adloco train` in a subprocess and summarise its metrics."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

import adloco
from adloco.config.input import layered

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_TOKENS = 1_536_000


def environment(load_before: float | None = None) -> dict:
    """What a figure was measured with: date, versions, machine, and the load before and after the work."""
    return {
        "date": date.today().isoformat(),
        "adloco": adloco.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads available",
        # Other work on the machine skews wall-clock figures; the load when a result was stored says how much.
        "load_average_1min": round(os.getloadavg()[0], 2),
        "load_average_before": None if load_before is None else round(load_before, 2),
    }


def describe(env: dict) -> str:
    load = ""
    if env.get("load_average_before") is not None:
        load = f", 1-min load average {env['load_average_before']} before and {env['load_average_1min']} after"
    versions = f"adloco {env['adloco']}, torch {env['torch']}, Python {env['python']}"
    return f"{env['date']}, {versions}, {env['machine']}{load}"


def train_run(name: str, overrides: list[str], root: Path, timeout: float = 3600) -> dict:
    """One real training run in its own process; returns the summary of its metrics.jsonl."""
    args = ["run.progress=false", "run.save_final=false", "run.plots=false", f"run.root={root}", f"run.name={name}"]
    command = [sys.executable, "-m", "adloco", "train", *layered(overrides, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"run {name} failed: {result.stderr.strip().splitlines()[-1:]}")
    return summarise(root / name / "metrics.jsonl", name, overrides)


def summarise(metrics_path: Path, name: str, overrides: list[str]) -> dict:
    """Final figures plus the curves the plots need (per evaluation: tokens, rounds, syncs, bytes, val loss)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    final = next(r for r in records if r["kind"] == "final")
    rounds = [r for r in records if r["kind"] == "round"]
    steps = sum(r["steps"] for r in rounds)
    method = next((o.split("=", 1)[1] for o in overrides if o.startswith("method=")), "diloco")
    # A synchronisation is one exchange of (a share of) the model: every step for DDP, every round otherwise;
    # a round that sent nothing (a lone worker) synchronised nothing.
    syncs_per_round = [0 if not r["bytes"] else r["steps"] if method == "ddp" else 1 for r in rounds]
    curve, syncs = [], 0
    for record, per_round in zip(rounds, syncs_per_round, strict=True):
        syncs += per_round
        if record.get("val_loss"):
            curve.append(
                {
                    "tokens": record["tokens"],
                    "round": record["round"],
                    "syncs": syncs,
                    "bytes": record["bytes_total"],
                    "seconds": record["seconds"],
                    "val_loss": min(record["val_loss"].values()),
                }
            )
    batches = [{"round": r["round"], "tokens": r["tokens"], "batch": r["batch"]} for r in rounds]
    val = final["val_loss"][str(final["best_trainer"])]
    return {
        "name": name,
        "overrides": [o.replace(f"{Path(__file__).resolve().parents[1]}/", "") for o in overrides],  # no machine paths
        "val_loss": val,
        "tokens": final["tokens"],
        "rounds": final["rounds"],
        "steps": steps,
        "syncs": syncs,
        "bytes": final["bytes_total"],
        "seconds": final["seconds"],
        "tokens_per_second": final["tokens"] / final["seconds"],
        "curve": curve,
        "batches": batches,
    }


def free_port() -> int:
    """A loopback port nobody listens on now (for a torchrun job's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(ranks: int) -> tuple[list[str], dict[str, str]]:
    """The start of a loopback torchrun command of ``ranks`` processes, and its environment: one thread per rank,
    and no rank variables of an outer job."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}"]  # fmt: skip
    return command, env
