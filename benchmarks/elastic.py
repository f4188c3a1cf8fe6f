"""An elastic torchrun job loses a machine: how long until it trains again, and with how many workers.

    python benchmarks/elastic.py

Two torchrun agents on loopback form one job of 1 to 2 "machines" (``--nnodes=1:2``, c10d rendezvous): one agent
of 2 processes, one of 1, DiLoCo with ``elastic=true`` and a checkpoint every round. Once the job has trained
``--kill-after`` rounds, the one-process agent and its rank are SIGKILLed, as when a machine goes away. torchrun
restarts the surviving agent's 2 processes, which resume the run with 2 workers instead of 3. Reports the round
resumed from, the workers before and after, and the seconds from the kill to the resumed round's start (from
``train.log``), and writes ``benchmarks/results/elastic.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common import environment, free_port

RESULTS = Path(__file__).parent / "results" / "elastic.json"
RUN = ["method=diloco", "elastic=true", "threads=1", "sync_every=4", "checkpoint.every=1", "comm.timeout_s=20",
       "eval.every=1000", "eval.final_full=false", "run.plots=false", "run.progress=false"]  # fmt: skip


def _agent(processes: int, port: int, root: Path, tokens: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc_per_node={processes}",
        "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-bench",
        "--monitor-interval=0.5", "--rdzv-conf=join_timeout=60,last_call_timeout=2,close_timeout=5",
        "-m", "adloco", "train", *RUN, f"total_tokens={tokens}", f"run.root={root}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _rounds(root: Path) -> int:
    metrics = list(root.glob("*/metrics.jsonl"))
    return metrics[0].read_text().count('"kind": "round"') if metrics else 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """The agent and its rank (torchrun starts ranks in sessions of their own)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [proc.pid, *map(int, children)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def trial(kill_after: int, tokens: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        root, port = Path(scratch) / "runs", free_port()
        big = _agent(2, port, root, tokens, Path(scratch) / "big.log")
        time.sleep(1)  # the first agent hosts the rendezvous store
        small = _agent(1, port, root, tokens, Path(scratch) / "small.log")
        deadline = time.monotonic() + timeout
        while _rounds(root) < kill_after and time.monotonic() < deadline and big.poll() is None:
            time.sleep(0.2)
        _kill_tree(small)
        killed = datetime.now()
        code = big.wait(timeout=max(1.0, deadline - time.monotonic()))
        log = next(root.glob("*/train.log")).read_text()
        resumed = re.search(r"^(\S+ \S+) INFO adloco: resumed from round (\d+)", log, re.M)
        resized = re.search(r"elastic: (\d+) workers in the checkpoint, (\d+) now", log)
        if code != 0 or resumed is None or resized is None:
            raise SystemExit(f"the job did not resume (exit {code}); train.log ends:\n{log[-2000:]}")
        at = datetime.strptime(resumed.group(1), "%Y-%m-%d %H:%M:%S,%f")
        return {
            "resumed_from_round": int(resumed.group(2)),
            "workers_before": int(resized.group(1)),
            "workers_after": int(resized.group(2)),
            "seconds_to_resume": round((at - killed).total_seconds(), 1),
            "finished": "done: val loss" in log,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-after", type=int, default=20, help="rounds trained before the machine goes")
    parser.add_argument("--tokens", type=int, default=200_000, help="the job's token budget")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    result = {"environment": environment(), "kill_after": args.kill_after, **trial(args.kill_after, args.tokens,
              args.timeout)}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
