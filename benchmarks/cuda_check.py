"""What only a GPU exercises, checked on one: every method of ``adloco train`` with its workers on the GPU (in
one process), the b_max probe under CUDA memory statistics, NCCL, a loop of your own over gloo and fault-tolerant
replicas with their models on the GPU.

    python benchmarks/cuda_check.py [--write] [--results PATH] [--only train|distributed]

Each check is its own process with a deadline; a check passes when its process ends well and, for training runs,
the final validation loss is finite and below the untrained model's (ln 256 ≈ 5.55 nats per byte). The test suite
(``python -m pytest``) runs on the CPU; this script is for a machine with a CUDA GPU. ``--write`` appends the call
to ``benchmarks/results/cuda.json``. One GPU is enough: processes that would each want a GPU of their own share
GPU 0 and exchange over gloo (NCCL allows one rank per GPU, so it is checked with one rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, environment, free_port, summarise, torchrun

TOKENS = 262_144
BASE = [
    "run.progress=false",
    "run.save_final=false",
    "run.plots=false",
    "run.trackers=[]",
    "eval.every=1000",
    "eval.final_full=false",
]
RUNS = {  # name: overrides of adloco train
    "diloco (4 workers stacked)": ["device=cuda"],
    "diloco on the CPU (reference)": ["device=cpu"],
    "diloco one worker at a time": ["device=cuda", "batched_workers=false"],
    "streaming fp4 overlap": ["device=cuda", "method=streaming", "codec.name=fp4-e2m1", "streaming.overlap=1"],
    "adloco": ["device=cuda", "method=adloco"],
    "muon + top-k 3%": ["device=cuda", "inner.optimizer=muon", "codec.name=topk", "codec.density=0.03"],
    "ddp": ["device=cuda", "method=ddp"],
    "b_max probe (0.2% of the GPU)": [
        "device=cuda",
        "method=adloco",
        "batch.b_cap=8192",
        "batch.memory.fraction=0.002",
    ],
}


def _run(command: list[str], timeout: float, env: dict | None = None) -> tuple[bool, float, str]:
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        ok, output = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout_error:
        ok, output = False, f"timed out after {timeout} s: {timeout_error.stderr or ''}"
    return ok, time.perf_counter() - start, output


def _trained(run_dir: Path, overrides: list[str]) -> dict:
    """The run's final figures, its peak CUDA memory and, when it probed, the b_max it found."""
    summary = summarise(run_dir / "metrics.jsonl", run_dir.name, overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [m.get("cuda_peak_allocated_mib") for r in records if r["kind"] == "round" for m in r.get("memory") or []]
    peaks = [p for p in peaks if p is not None]
    probe = re.search(r"b_max probe on \S+: (\d+) samples per micro-batch fit in (\d+) MiB", _log(run_dir))
    figures = {k: summary[k] for k in ("val_loss", "tokens", "rounds", "bytes", "tokens_per_second")}
    figures["train_seconds"] = summary["seconds"]
    figures["cuda_peak_allocated_mib"] = max(peaks) if peaks else None
    if probe:
        figures["b_max"], figures["probe_budget_mib"] = int(probe.group(1)), int(probe.group(2))
    return figures


def _log(run_dir: Path) -> str:
    path = run_dir / "train.log"
    return path.read_text() if path.exists() else ""


def train_checks(root: Path) -> list[dict]:
    results = []
    for name, overrides in RUNS.items():
        run = re.sub(r"\W+", "-", name).strip("-")
        args = [*overrides, f"total_tokens={TOKENS}", *BASE, f"run.root={root}", f"run.name={run}"]
        ok, seconds, output = _run([sys.executable, "-m", "adloco", "train", *args], timeout=300)
        result = {"check": f"adloco train: {name}", "overrides": overrides, "passed": ok, "seconds": seconds}
        if ok:
            result.update(_trained(root / run, overrides))
            result["passed"] = math.isfinite(result["val_loss"]) and result["val_loss"] < math.log(256)
        else:
            result["error"] = output.strip().splitlines()[-5:]
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def _outcome(name: str, ok: bool, seconds: float, output: str, **figures) -> dict:
    result = {"check": name, "passed": ok, "seconds": seconds, **figures}
    if not ok:
        result["error"] = output.strip().splitlines()[-8:]
    print(json.dumps(result), flush=True)
    return result


def distributed_checks(root: Path) -> list[dict]:
    """NCCL with one rank (a GPU holds one NCCL rank), a user's loop of 2 ranks on GPU 0 over gloo, and
    fault-tolerant replicas with their models on the GPU: the replica tests with ADLOCO_TEST_DEVICE=cuda, and one
    replica whose exchange is NCCL."""
    results = []
    command, env = torchrun(1)
    args = ["device=cuda", "comm.backend=nccl", "workers=2", f"total_tokens={TOKENS // 4}", *BASE]
    args += [f"run.root={root}", "run.name=nccl"]
    ok, seconds, output = _run([*command, "-m", "adloco", "train", *args], 300, env)
    figures = _trained(root / "nccl", args) if ok else {}
    results.append(_outcome("torchrun 1 rank, comm.backend=nccl, 2 workers", ok, seconds, output, **figures))
    command, env = torchrun(2)
    loop = ["examples/plain_loop.py", "--device", "cuda", "--steps", "200"]
    ok, seconds, output = _run([*command, *loop], 300, env)
    line = re.search(r"val loss (\S+), (\S+) tokens/s", output)
    figures = {"val_loss": float(line.group(1)), "tokens_per_second": line.group(2)} if line else {}
    results.append(_outcome("a user's loop, 2 ranks on GPU 0 over gloo", ok and bool(line), seconds, output, **figures))
    env = {**os.environ, "ADLOCO_TEST_DEVICE": "cuda"}
    # -m "": the stress tier too (the fault scenarios the CPU suite leaves out), on a machine with cores to spare;
    # -n 0: one scenario at a time, as their pass rates were measured
    pytest = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "", "-p", "no:cacheprovider",
              "tests/api/test_replica.py"]  # fmt: skip
    ok, seconds, output = _run(pytest, 450, env)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    results.append(_outcome("replica tests with the models on GPU 0 (gloo)", ok, seconds, output, pytest=summary))
    results.append(_nccl_replica(root))
    return results


def _nccl_replica(root: Path) -> dict:
    port = free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "adloco", "lighthouse", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    try:
        time.sleep(3.0)
        loop = [sys.executable, "tests/api/replica_loop.py", str(root), "--replica", "0", "--replicas", "1"]
        loop += ["--lighthouse", f"http://127.0.0.1:{port}", "--device", "cuda", "--backend", "nccl", "--steps", "12"]
        ok, seconds, output = _run(loop, 180)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    result = json.loads((root / "replica0.json").read_text()) if ok else {}
    rounds = result.get("rounds")
    return _outcome("one replica, exchange over NCCL", ok and rounds == 3, seconds, output, rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="store the results")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "cuda.json"))
    parser.add_argument("--only", choices=["train", "distributed"], default=None, help="one half of the checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_check: no CUDA GPU here; the CPU test suite is python -m pytest")
    with tempfile.TemporaryDirectory() as tmp:
        checks = [] if args.only == "distributed" else train_checks(Path(tmp))
        checks += [] if args.only == "train" else distributed_checks(Path(tmp))
    environment_ = {**environment(), "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    passed = sum(c["passed"] for c in checks)
    print(f"{passed} passed, {len(checks) - passed} failed")
    if args.write:  # each call is kept: a fix between calls shows as a check that failed, then passed
        path = Path(args.results)
        stored = json.loads(path.read_text()) if path.exists() else {"runs": []}
        stored["runs"].append({"call": len(stored["runs"]) + 1, "environment": environment_, "checks": checks})
        path.write_text(json.dumps(stored, indent=1) + "\n")
    sys.exit(0 if passed == len(checks) else 1)


if __name__ == "__main__":
    main()
