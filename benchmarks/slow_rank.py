"""What a slow rank costs a fast one: rank 0's time per round with rank 1 at full speed and held to part of a core.

    python benchmarks/slow_rank.py --write            # every method, rank 1 at 100% and 40% (~8 min)
    python benchmarks/slow_rank.py --fractions 1,0.25 --methods diloco

Two ranks on loopback, each pinned to its own core with ``taskset``; rank 1 runs inside a CPU cgroup whose quota
(``cpu.cfs_quota_us`` of cgroup v1, or ``cpu.max`` of cgroup v2) lets it use ``--fractions`` of one core. That is
a real slowdown of the process, with no sleep in the code. Rank 0 writes metrics.jsonl; every round record
carries its blocking exchanges and the seconds it waited in them, which is where a slow peer shows.

Results go to benchmarks/results/slow_rank.json; ``--write`` also puts the table into docs/distributed.md between
the slow-rank markers. Needs root, Linux, two cores and ``taskset``; otherwise the script says why, prints
"skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from link import COMMON, ROOT, LinkError, MetricsTail, launch_job, machine, publish

DOC = ROOT / "docs" / "distributed.md"
RESULTS = ROOT / "benchmarks" / "results" / "slow_rank.json"
BEGIN, END = "<!-- slow-rank:begin -->", "<!-- slow-rank:end -->"
PERIOD_US = 100_000
METHODS = {
    "ddp": ["method=ddp"],
    "diloco": ["method=diloco"],
    "diloco-speed-shares": ["method=diloco", "batch.shares=speed"],
    "streaming": ["method=streaming", "streaming.fragments=2"],
}


def cgroup_root() -> tuple[Path, str] | None:
    """Where CPU groups are made and which interface they speak: ("v1", cfs files) or ("v2", cpu.max)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return v2, "v2"
    return None


def unavailable() -> str | None:
    """Why the slow rank cannot be made here, or None when it can."""
    if sys.platform != "linux":
        return f"CPU cgroups need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating a CPU cgroup needs root"
    if shutil.which("taskset") is None:
        return "'taskset' is missing (apt-get install -y util-linux)"
    if len(os.sched_getaffinity(0)) < 2:
        return "two cores are needed, one per rank"
    if cgroup_root() is None:
        return "no CPU cgroup controller is mounted"
    return None


@contextmanager
def cpu_quota(fraction: float, name: str = "adloco-slow-rank") -> Iterator[Path]:
    """A CPU cgroup allowed ``fraction`` of one core; yields the file a process writes its pid to, to join it."""
    found = cgroup_root()
    if found is None:
        raise LinkError("no CPU cgroup controller is mounted")
    root, version = found
    group = root / name
    group.mkdir(exist_ok=True)
    quota = int(fraction * PERIOD_US)
    try:
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        yield group / "cgroup.procs"
    finally:
        with suppress(OSError):  # the group's processes are gone by now; rmdir only fails if one lingers
            group.rmdir()


@dataclass(frozen=True)
class Loopback:
    """Ranks on 127.0.0.1, rank k pinned to core k, optionally placed in a CPU cgroup (see ``launch_job``)."""

    cores: tuple[int, ...]
    groups: tuple[Path | None, ...]

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(f"rank{k}" for k in range(len(self.cores)))

    @property
    def addresses(self) -> tuple[str, ...]:
        return ("127.0.0.1",) * len(self.cores)

    @property
    def interfaces(self) -> tuple[str, ...]:
        return ("lo",) * len(self.cores)

    def exec_prefix(self, rank: int) -> list[str]:
        """taskset to the rank's core; the shell joins the cgroup first, so every thread starts inside it."""
        pin = ["taskset", "-c", str(self.cores[rank])]
        group = self.groups[rank]
        return pin if group is None else ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group), *pin]


def round_figures(records: Sequence[dict[str, Any]], skip: int = 1) -> dict[str, Any]:
    """Medians over rounds (the first ``skip`` left out: warm-up) of rank 0's round time and its waits; the
    whole run's training time and final loss; each worker's samples per step in the last round."""
    rounds = [r for r in records if r.get("kind") == "round"][skip:]
    final = [r for r in records if r.get("kind") == "final"]
    if not rounds or not final:
        raise LinkError("the run wrote no round record after the warm-up, or no final record")
    own = [r["ranks"][0] for r in rounds]
    return {
        "train_seconds": final[-1]["seconds"],
        "final_val_loss": min(final[-1]["val_loss"].values()),
        "samples": rounds[-1].get("samples"),
        "rounds": len(rounds),
        "steps_per_round": statistics.median(r["steps"] for r in rounds),
        "round_seconds": statistics.median(r["round_seconds"] for r in rounds),
        "wait_seconds": statistics.median(o["wait_seconds"] for o in own),
        "exchanges": statistics.median(o["exchanges"] for o in own),
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rounds),
    }


def run_one(method: str, fraction: float, args: argparse.Namespace) -> dict[str, Any]:
    """One two-rank job, rank 1 held to ``fraction`` of a core (1 = not held); rank 0's figures."""
    name = f"{method}-rank1-{round(fraction * 100)}pct"
    settings = [*COMMON, *METHODS[method], "workers=2", f"sync_every={args.sync_every}"]
    settings += [f"total_tokens={args.tokens}", f"seed={args.seed}", "eval.every=1000000", *args.extra]
    logs = args.out / f"{name}.logs"
    if (args.out / name).exists():
        shutil.rmtree(args.out / name)
    logs.mkdir(parents=True, exist_ok=True)
    overrides = [*settings, f"run.root={args.out}", f"run.name={name}"]
    print(f"  {name} ...", flush=True)
    with cpu_quota(fraction) if fraction < 1 else _no_group() as group:
        placement = Loopback(cores=(0, 1), groups=(None, group))
        launch_job(placement, overrides, args.job_timeout, port=args.port, logs=logs)  # type: ignore[arg-type]
    args.port += 1
    figures = round_figures(MetricsTail(args.out / name / "metrics.jsonl").poll())
    print(f"    {figures['round_seconds']:.2f} s per round, {figures['wait_seconds']:.2f} s waiting", flush=True)
    return {"method": method, "fraction": fraction, "overrides": settings, **figures}


@contextmanager
def _no_group() -> Iterator[None]:
    yield None


def markdown(report: dict[str, Any]) -> str:
    """The table docs/distributed.md shows, with how it was measured."""
    v = report["versions"]
    lines = [
        f"Measured {report['date']} with `{report['command']}`: adloco {v['adloco']}, torch {v['torch']}, "
        f"Python {v['python']}; {report['machine']}. Two ranks on loopback, one thread each, each pinned to its "
        f"own core; H = {report['sync_every']}; medians over rounds after the first.",
        "",
        "| method | rank 1's CPU | rank 0's s per round | of which waiting | exchanges per round | wait per exchange "
        "| samples per step (rank 0, rank 1) | training s | final val loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        per_exchange = row["wait_seconds"] / row["exchanges"] if row["exchanges"] else 0.0
        samples = row.get("samples")
        split = "equal" if not samples else ", ".join(str(samples[k]) for k in sorted(samples, key=int))
        lines.append(
            f"| {row['method']} | {row['fraction']:.0%} of a core | {row['round_seconds']:.2f} "
            f"| {row['wait_seconds']:.2f} s | {row['exchanges']:g} | {per_exchange * 1e3:.0f} ms "
            f"| {split} | {row['train_seconds']:.1f} | {row['final_val_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ",".join(METHODS))
    parser.add_argument("--fractions", default="1,0.4", help="rank 1's share of a core, e.g. 1,0.4 (1 = not held)")
    parser.add_argument("--tokens", type=int, default=48_000, help="training tokens per run (default 48000)")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps per round, H (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29800, help="first rendezvous port (one per job)")
    parser.add_argument("--job-timeout", type=float, default=1200.0, help="seconds before a job is killed")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "slow-rank", help="run directories and logs")
    parser.add_argument("--json", type=Path, default=RESULTS, help="results file (default benchmarks/results/)")
    parser.add_argument("--write", action="store_true", help="put the table into --doc between the markers")
    parser.add_argument("--doc", type=Path, default=DOC, help="default docs/distributed.md")
    parser.add_argument("extra", nargs="*", help="further overrides for every run")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(m not in METHODS for m in methods):
        parser.error(f"--methods: choose from {', '.join(METHODS)}, got {args.methods!r}")
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        parser.error(f"--fractions wants numbers, got {args.fractions!r}")
    if not all(0.05 <= f <= 1 for f in fractions):
        parser.error(f"--fractions must lie between 0.05 and 1, got {args.fractions!r}")
    if args.write and not (args.doc.exists() and BEGIN in args.doc.read_text() and END in args.doc.read_text()):
        parser.error(f"--write: {args.doc} has no {BEGIN} ... {END} markers")
    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    import torch

    import adloco

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/slow_rank.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {"adloco": adloco.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": machine(),
        "sync_every": args.sync_every,
        "rows": [],
    }
    try:
        for method in methods:
            for fraction in fractions:
                report["rows"].append(run_one(method, fraction, args))
    except LinkError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    publish(report, markdown(report), args.json, args.doc if args.write else None, (BEGIN, END))
    return 0


if __name__ == "__main__":
    sys.exit(main())
