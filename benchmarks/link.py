"""Time to DDP's final validation loss over a real bandwidth-limited link (Linux network namespaces).

    python benchmarks/link.py --write                      # 100 Mbit/s and 1 Gbit/s, 2 ranks (~15-20 min idle)
    python benchmarks/link.py --rates 100 --tokens 32000   # a quick look (~3 min)
    python benchmarks/link.py --ranks 4 --methods ddp,diloco

Every rank runs in its own network namespace (rank k at 10.77.0.<k+1>) and reaches the others through a bridge
in a hub namespace, like machines on one switch. Each rank's veth pair carries a ``tc`` token-bucket filter
(tbf) on both ends, so a rank's upload and download are both limited to the rate. The ranks are started by
hand with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and gloo bound to the rank's veth end.
The rate is first checked with a TCP transfer from rank 0 to rank 1.

DDP trains on ``--tokens``; its final validation loss is the target. The other methods get up to
``--budget-factor`` times as many tokens (their learning-rate schedule spans that budget) and are stopped as
soon as a periodic evaluation reaches the target. Time is training time: the run's clock minus the periodic
evaluations (``eval_seconds`` in metrics.jsonl); every evaluation uses the same validation blocks.

Results go to benchmarks/results/link.json; ``--write`` also puts the Markdown tables into
docs/link-and-peers.md between the link markers. Needs root, ``ip`` and ``tc``; otherwise the script says why,
prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "link-and-peers.md"
RESULTS = ROOT / "benchmarks" / "results" / "link.json"
BEGIN, END = "<!-- link:begin -->", "<!-- link:end -->"
SUBNET = "10.77.0"
TBF_LATENCY = "400ms"  # how long a packet may wait in the bucket's queue before tbf drops it (not a delay)

# Issue 6: on the 100 Mbit/s link, time to DDP's final loss >= 10x shorter than DDP's and >= 1.3x shorter
# than DiLoCo's.
TARGET_RATE, TARGET_VS_DDP, TARGET_VS_DILOCO = 100, 10.0, 1.3


def burst_for(rate_mbit: int) -> str:
    """tbf bucket size: 32 kbit up to 100 Mbit/s, one millisecond of traffic above (32 kbit caps 1 Gbit at ~0.5)."""
    return f"{max(32, rate_mbit if rate_mbit > 100 else 32)}kbit"


# Overrides shared by every run: one slot and one thread per rank, frequent cheap evaluation on fixed blocks
# (the final evaluation uses the same blocks, so DDP's final loss is comparable with everyone's periodic ones).
COMMON = [
    "threads=1",
    "eval.every=2",
    "eval.blocks=32",
    "eval.final_full=false",
    "checkpoint.every=1000000",
    "run.progress=false",
    "run.save_final=false",
    "run.plots=false",
    "run.trackers=[]",
    "comm.timeout_s=120",
]


def method_overrides(method: str, ranks: int) -> list[str]:
    """The overrides of one benchmarked method on ``ranks`` ranks (one worker slot per rank)."""
    workers = f"workers={ranks}"
    table = {
        "ddp": ["method=ddp", workers],
        "diloco": ["method=diloco", workers],
        "streaming-fp4": ["method=streaming", "codec.name=fp4-e2m1", workers],
        # One trainer per rank, merged pairwise every merge.every rounds: the same workers as the others.
        "adloco": ["method=adloco", f"trainers={ranks}", "workers=1"],
        # The README's gentler norm test (batches grow later), not in the default list.
        "adloco-eta2.5": ["method=adloco", f"trainers={ranks}", "workers=1", "batch.eta=2.5", "batch.ema=0.5"],
    }
    return table[method]


METHODS = ("ddp", "diloco", "streaming-fp4", "adloco", "adloco-eta2.5")
DEFAULT_METHODS = ("ddp", "diloco", "streaming-fp4", "adloco")


class LinkError(RuntimeError):
    """Setting up or using the namespace link failed."""


def netns_unavailable() -> str | None:
    """Why namespaces with tc limits cannot be used here, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (apt-get install -y iproute2)"
    probe = f"adlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LinkError(f"{' '.join(command)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Link:
    """Rank namespaces joined through a bridge in a hub namespace, every veth end limited to ``rate_mbit``."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]
    hub: str
    rate_mbit: int

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]


def _delete_namespaces(names: Sequence[str]) -> None:
    for name in names:
        # Deleting a namespace also deletes the veth ends inside it, and with them their peers.
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _tbf(namespace: str, device: str, rate_mbit: int) -> None:
    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
          f"{rate_mbit}mbit", "burst", burst_for(rate_mbit), "latency", TBF_LATENCY])  # fmt: skip


@contextmanager
def namespace_link(rate_mbit: int, ranks: int = 2, prefix: str = "adl") -> Iterator[Link]:
    """Create the namespaces, bridge and limited veth pairs; always remove them on the way out.

    Nothing is created in the caller's own namespace: every interface is made directly inside its namespace.
    """
    if not 2 <= ranks <= 8:
        raise LinkError(f"ranks must be between 2 and 8, got {ranks}")
    names = tuple(f"{prefix}ns{k}" for k in range(ranks))
    hub, bridge = f"{prefix}hub", f"{prefix}br"
    interfaces = tuple(f"{prefix}v{k}" for k in range(ranks))
    addresses = tuple(f"{SUBNET}.{k + 1}" for k in range(ranks))
    _delete_namespaces([*names, hub])  # left over from a run that was killed before its cleanup
    try:
        for name in (*names, hub):
            _run(["ip", "netns", "add", name])
        _run(["ip", "-n", hub, "link", "add", bridge, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", bridge, "up"])
        for rank in range(ranks):
            ns, dev, port = names[rank], interfaces[rank], f"{prefix}p{rank}"
            _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", hub])
            _run(["ip", "-n", hub, "link", "set", port, "master", bridge])
            _run(["ip", "-n", hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addresses[rank]}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _tbf(ns, dev, rate_mbit)  # the rank's upload
            _tbf(hub, port, rate_mbit)  # the rank's download
        yield Link(names, interfaces, addresses, hub, rate_mbit)
    finally:
        _delete_namespaces([*names, hub])


_RECEIVER = """
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
server.settimeout(60)
print("ready", flush=True)
conn, _ = server.accept()
conn.settimeout(60)
total, first = 0, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    if first is None:
        first = time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - first, flush=True)
"""

_SENDER = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
payload = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    sock.sendall(payload)
sock.close()
"""


def measure_rate(link: Link, megabytes: int = 8, port: int = 29600, src: int = 0, dst: int = 1) -> float:
    """Mbit/s achieved by one TCP stream from rank ``src``'s namespace to rank ``dst``'s (counted at the receiver)."""
    receiver = subprocess.Popen(
        [*link.exec_prefix(dst), sys.executable, "-c", _RECEIVER, link.addresses[dst], str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if receiver.stdout is None or receiver.stdout.readline().strip() != "ready":
            raise LinkError(f"rate probe receiver did not start: {receiver.stderr.read() if receiver.stderr else ''}")
        subprocess.run(
            [*link.exec_prefix(src), sys.executable, "-c", _SENDER, link.addresses[dst], str(port), str(megabytes)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out, err = receiver.communicate(timeout=60)
    except subprocess.CalledProcessError as error:
        raise LinkError(f"rate probe sender failed: {error.stderr.decode().strip()[-300:]}") from error
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.communicate()
    try:
        received, seconds = out.split()
    except ValueError as error:
        raise LinkError(f"rate probe failed: {err.strip()}") from error
    if int(received) != megabytes << 20:
        raise LinkError(f"rate probe received {received} of {megabytes << 20} bytes")
    return int(received) * 8 / float(seconds) / 1e6


class MetricsTail:
    """Reads a growing metrics.jsonl incrementally, keeping every record but the per-step ones."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """Records written so far (a line still being written is left for the next call)."""
        if not self.path.exists():
            return self.records
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data.rfind(b"\n") + 1
        for line in data[:complete].splitlines():
            if line.strip():
                record = json.loads(line)
                if record.get("kind") != "step":
                    self.records.append(record)
        self.offset += complete
        return self.records


def launch_job(
    link: Link,
    overrides: Sequence[str],
    timeout_s: float,
    port: int = 29500,
    logs: Path | None = None,
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Run one ``adloco train`` job, rank k inside namespace k; True when ``stop()`` ended it early.

    ``stop`` is polled about twice a second; when it returns True every rank is killed. Raises LinkError when a
    rank fails or the job outlives ``timeout_s``. Each rank's stderr goes to ``logs``/rank<k>.log.
    """
    ranks = len(link.namespaces)
    base_env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")}
    procs: list[subprocess.Popen] = []
    log_files = []
    try:
        for rank in range(ranks):
            env = {
                **base_env,
                "RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": link.addresses[0],
                "MASTER_PORT": str(port),
                # gloo would otherwise pick the interface the host name resolves to, which is not in the namespace.
                "GLOO_SOCKET_IFNAME": link.interfaces[rank],
                "PYTHONWARNINGS": "ignore",
            }
            # A pipe could fill up while we only poll; a file never blocks the rank.
            log = (logs / f"rank{rank}.log").open("w") if logs is not None else subprocess.DEVNULL
            log_files.append(log)
            procs.append(
                subprocess.Popen(
                    [*link.exec_prefix(rank), sys.executable, "-m", "adloco", "train", *overrides],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise LinkError(f"rank {rank} exited {code}: {_last_line(logs, rank)}")
            if all(code == 0 for code in codes):
                return False
            if stop is not None and stop():
                return True
            if time.monotonic() > deadline:
                raise LinkError(f"job did not finish within {timeout_s:.0f} s")
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for log in log_files:
            if log is not subprocess.DEVNULL:
                log.close()


def _last_line(logs: Path | None, rank: int) -> str:
    path = logs / f"rank{rank}.log" if logs is not None else None
    if path is None or not path.exists():
        return "(no log)"
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(empty log)"


def evaluations(records: Sequence[dict[str, Any]]) -> Iterator[tuple[float, int, float]]:
    """(training seconds, tokens, best trainer's val loss) of every periodic evaluation, in order.

    Training seconds are the run's clock minus the evaluations so far, this one included.
    """
    eval_total = 0.0
    for record in records:
        if record.get("kind") != "round":
            continue
        eval_total += float(record.get("eval_seconds") or 0.0)
        if record.get("val_loss"):
            loss = min(float(v) for v in record["val_loss"].values())
            yield float(record["seconds"]) - eval_total, int(record["tokens"]), loss


def final_val_loss(records: Sequence[dict[str, Any]]) -> float:
    """The best trainer's validation loss in the run's ``final`` record."""
    final = next((r for r in records if r["kind"] == "final"), None)
    if final is None:
        raise LinkError("the run wrote no final record")
    return min(float(v) for v in final["val_loss"].values())


def time_to_target(records: Sequence[dict[str, Any]], target: float) -> tuple[float, int] | None:
    """Training seconds and tokens at the first evaluation whose best trainer reached ``target``; None if never."""
    for seconds, tokens, loss in evaluations(records):
        if loss <= target:
            return seconds, tokens
    return None


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(records: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """What the table shows for one run, finished or stopped at the target."""
    rounds = [r for r in records if r["kind"] == "round"]
    if not rounds:
        raise LinkError("the run wrote no round record")
    evaluated = list(evaluations(records))
    reached = time_to_target(records, target)
    finished = any(r["kind"] == "final" for r in records)
    eval_total = sum(float(r.get("eval_seconds") or 0.0) for r in rounds)
    return {
        "finished": finished,
        "val_loss": final_val_loss(records) if finished else evaluated[-1][2],
        "seconds": float(rounds[-1]["seconds"]) - eval_total,
        "eval_seconds": eval_total,
        "tokens": int(rounds[-1]["tokens"]),
        "rounds": len(rounds),
        "bytes": int(rounds[-1]["bytes_total"]),
        "comm_seconds": sum(float(r.get("comm_seconds") or 0.0) for r in rounds),
        "time_to_target": reached[0] if reached else None,
        "tokens_to_target": reached[1] if reached else None,
    }


def run_rate(link: Link, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every method at one rate; DDP first, as its final loss is the target."""
    results: dict[str, Any] = {}
    port = 29500
    ranks = len(link.namespaces)
    for method in ["ddp", *[m for m in args.methods if m != "ddp"]]:
        tokens = args.tokens if method == "ddp" else int(args.tokens * args.budget_factor)
        name = f"{method}-{link.rate_mbit}mbit-{ranks}ranks"
        settings = [*COMMON, *method_overrides(method, ranks), f"total_tokens={tokens}", f"seed={args.seed}"]
        settings += args.extra
        overrides = [*settings, f"run.root={root}", f"run.name={name}"]  # the results keep only the settings
        target = results["ddp"]["val_loss"] if method != "ddp" else None
        metrics = root / name / "metrics.jsonl"
        tail = MetricsTail(metrics)
        old = _read(metrics) if args.reuse and metrics.exists() and _same_run(root / name, tokens, args.seed) else []
        reuse = any(r["kind"] == "final" for r in old) or (
            target is not None and time_to_target(old, target) is not None
        )
        print(f"  {name}: up to {tokens:,} tokens{' (reused)' if reuse else ''} ...", flush=True)
        started = time.monotonic()
        try:
            if not reuse:
                if (root / name).exists():
                    shutil.rmtree(root / name)  # a half-written run of an earlier attempt
                logs = root / f"{name}.logs"
                logs.mkdir(parents=True, exist_ok=True)

                def reached(tail: MetricsTail = tail, target: float | None = target) -> bool:
                    return target is not None and time_to_target(tail.poll(), target) is not None

                stop = None if args.run_to_budget else reached
                launch_job(link, overrides, args.job_timeout, port=port, logs=logs, stop=stop)
            records = tail.poll()
            result = summarise(records, target if target is not None else final_val_loss(records))
        except LinkError as error:
            print(f"  {name}: failed: {error}", flush=True)
            results[method] = {"error": str(error), "overrides": settings}
            if method == "ddp":
                break
            continue
        finally:
            port += 1  # a fresh port per job: the previous store's socket may linger in TIME_WAIT
        results[method] = {"overrides": settings, "reused": reuse, "stopped_at_target": not result["finished"]}
        results[method].update(result)
        results[method]["wall_seconds"] = time.monotonic() - started
        r = results[method]
        reached_text = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.1f} s"
        print(f"  {name}: val {r['val_loss']:.4f} after {r['seconds']:.1f} s, target {reached_text}", flush=True)
    return results


def _same_run(run_dir: Path, tokens: int, seed: int) -> bool:
    """Whether a run left in ``run_dir`` had this budget and seed (--reuse must not mix budgets)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.exists():
        return False
    config = yaml.safe_load(path.read_text()) or {}
    return config.get("total_tokens") == tokens and config.get("seed") == seed


def target_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each method's speed-ups to the target over DDP and DiLoCo, against the issue's thresholds."""
    base = {m: results.get(m, {}).get("time_to_target") for m in ("ddp", "diloco")}
    checks = []
    for method, r in results.items():
        if method == "ddp":
            continue
        t = r.get("time_to_target")
        check: dict[str, Any] = {"method": method}
        for other, threshold in (("ddp", TARGET_VS_DDP), ("diloco", TARGET_VS_DILOCO)):
            if other == method:
                continue
            ratio = base[other] / t if t and base[other] else None
            check[f"vs_{other}"] = ratio
            check[f"vs_{other}_met"] = ratio is not None and ratio >= threshold
        checks.append(check)
    return checks


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def rate_table(rate_mbit: int, measured_mbit: float, results: dict[str, Any]) -> str:
    """Markdown table of one rate's runs."""
    target = results.get("ddp", {}).get("val_loss")
    lines = [
        f"**{rate_mbit} Mbit/s** tbf (measured {measured_mbit:.0f} Mbit/s rank 0 → rank 1); target = DDP's final "
        "val loss " + (f"{target:.4f}" if target is not None else "(DDP failed)"),
        "",
        "| method | tokens run | val loss at end | training s | comm s | bytes sent | time to target "
        "| tokens to target | speed-up vs DDP | vs DiLoCo |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {m: results.get(m, {}).get("time_to_target") for m in ("ddp", "diloco")}
    for method, r in results.items():
        if "error" in r:
            lines.append(f"| {method} | — | failed: {r['error'][:80]} | | | | | | | |")
            continue
        t = r["time_to_target"]
        vs = [_ratio(base[m] / t if t and base[m] else None) for m in ("ddp", "diloco")]
        to_target = "—" if r["tokens_to_target"] is None else f"{r['tokens_to_target']:,}"
        run = f"{r['tokens']:,}" + (" (stopped)" if r.get("stopped_at_target") else "")
        lines.append(
            f"| {method} | {run} | {r['val_loss']:.4f} | {r['seconds']:.1f} | {r['comm_seconds']:.1f} "
            f"| {r['bytes'] / 1e6:,.1f} MB | {'not reached' if t is None else f'{t:.1f} s'} | {to_target} "
            f"| {vs[0]} | {vs[1]} |"
        )
    return "\n".join(lines)


def targets_text(checks: list[dict[str, Any]] | None) -> str:
    """The issue's targets, met or not, per method."""
    head = (
        f"Targets on the {TARGET_RATE} Mbit/s link: time to DDP's final loss ≥ {TARGET_VS_DDP:g}× shorter than "
        f"DDP's and ≥ {TARGET_VS_DILOCO:g}× shorter than DiLoCo's."
    )
    if checks is None:
        return head + f" Not measured (the {TARGET_RATE} Mbit/s rate was not run)."
    lines = [head, ""]
    for check in checks:
        parts = []
        for other, threshold in (("ddp", TARGET_VS_DDP), ("diloco", TARGET_VS_DILOCO)):
            if f"vs_{other}" not in check:
                continue
            ratio = check[f"vs_{other}"]
            figure = "target not reached" if ratio is None else f"{ratio:.2f}×"
            verdict = "met" if check[f"vs_{other}_met"] else "not met"
            parts.append(f"≥ {threshold:g}× vs {'DDP' if other == 'ddp' else 'DiLoCo'}: **{verdict}** ({figure})")
        lines.append(f"- {check['method']}: " + "; ".join(parts))
    return "\n".join(lines)


def machine() -> str:
    """CPU model, core count and kernel of this machine."""
    model = platform.machine()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    kernel = platform.release().split("-")[0]  # the version, without the distribution's build tag
    return f"{model}, {os.cpu_count()} cores, Linux {kernel}"


def write_between(doc: Path, begin: str, end: str, body: str) -> None:
    """Replace what lies between the ``begin`` and ``end`` markers of ``doc`` with ``body``."""
    text = doc.read_text()
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise LinkError(f"{doc} has no {begin} ... {end} markers")
    start, stop = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:start] + "\n" + body.strip() + "\n" + text[stop:])


def publish(report: dict[str, Any], text: str, json_path: Path, doc: Path | None, markers: tuple[str, str]) -> None:
    """Store ``report`` as JSON, print ``text``, and put it between ``markers`` in ``doc`` when one is given."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"written: {json_path}")
    if doc is not None:
        write_between(doc, *markers, text)
        print(f"written: {doc}")


def markdown(report: dict[str, Any]) -> str:
    """The section docs/link-and-peers.md shows: provenance, one table per rate, the targets."""
    v = report["versions"]
    head = (
        f"Measured {report['date']} with `{report['command']}`: adloco {v['adloco']}, torch {v['torch']}, "
        f"Python {v['python']}; {report['machine']}. {report['ranks']} ranks × 1 thread, seed {report['seed']}; "
        f"DDP {report['ddp_tokens']:,} tokens, the others up to {report['other_tokens']:,}"
        + (" (stopped once they reach the target)." if not report["run_to_budget"] else ".")
    )
    tables = [rate_table(int(rate), r["measured_mbit"], r["results"]) for rate, r in report["rates"].items()]
    return "\n\n".join([head, *tables, targets_text(report.get("targets"))])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--ranks", type=int, default=2, help="ranks, one namespace each (2-4 sensible)")
    parser.add_argument("--tokens", type=int, default=256_000, help="DDP's training tokens (default 256000)")
    parser.add_argument("--budget-factor", type=float, default=2.0, help="other methods' token cap / DDP's")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated, of " + ",".join(METHODS))
    parser.add_argument("--run-to-budget", action="store_true", help="do not stop a method at the target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds before a job is killed")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "link", help="run directories and logs")
    parser.add_argument("--json", type=Path, default=RESULTS, help="results file (default benchmarks/results/)")
    parser.add_argument("--write", action="store_true", help="put the tables into --doc between the link markers")
    parser.add_argument("--doc", type=Path, default=DOC, help="default docs/link-and-peers.md")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --out, run the rest")
    parser.add_argument("extra", nargs="*", help="further overrides for every run")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    try:
        rates = [int(r) for r in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates wants integers in Mbit/s, got {args.rates!r}")
    if any(r <= 0 for r in rates):
        parser.error(f"--rates must be positive, got {args.rates!r}")
    if not 2 <= args.ranks <= 8:
        parser.error(f"--ranks must be between 2 and 8, got {args.ranks}")
    if args.tokens <= 0 or args.budget_factor < 1:
        parser.error("--tokens must be positive and --budget-factor at least 1")
    if args.write and not (args.doc.exists() and BEGIN in args.doc.read_text() and END in args.doc.read_text()):
        parser.error(f"--write: {args.doc} has no {BEGIN} ... {END} markers")
    reason = netns_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0

    import torch

    import adloco

    # A plain SIGTERM would end Python without running the cleanup that deletes the namespaces.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/link.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {"adloco": adloco.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": machine(),
        "ranks": args.ranks,
        "seed": args.seed,
        "ddp_tokens": args.tokens,
        "other_tokens": int(args.tokens * args.budget_factor),
        "run_to_budget": args.run_to_budget,
        "tbf": {"burst": {str(r): burst_for(r) for r in rates}, "latency": TBF_LATENCY},
        "rates": {},
    }
    try:
        for rate in rates:
            print(f"link at {rate} Mbit/s, {args.ranks} ranks", flush=True)
            with namespace_link(rate, args.ranks) as link:
                measured = measure_rate(link, megabytes=max(4, min(64, rate // 8)))
                print(f"  measured {measured:.1f} Mbit/s", flush=True)
                results = run_rate(link, args, args.out)
            report["rates"][str(rate)] = {"measured_mbit": measured, "results": results}
    except LinkError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if str(TARGET_RATE) in report["rates"]:
        report["targets"] = target_checks(report["rates"][str(TARGET_RATE)]["results"])
    publish(report, markdown(report), args.json, args.doc if args.write else None, (BEGIN, END))
    return 0


if __name__ == "__main__":
    sys.exit(main())
