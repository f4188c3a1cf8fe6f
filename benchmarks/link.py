"""Time to DDP's final validation loss over a real bandwidth-limited link (Linux network namespaces).

    python benchmarks/link.py --write                      # 100 Mbit/s and 1 Gbit/s, 2 ranks (~15-20 min idle)
    python benchmarks/link.py --rates 100 --tokens 32000   # a quick look (~3 min)
    python benchmarks/link.py --ranks 4 --methods ddp,diloco
    python benchmarks/link.py --adaptive --ranks 2,4 --write eval.every=1   # AdLoCo vs DiLoCo at H 10/20/50
    python benchmarks/link.py --adaptive --links 100@50 --write eval.every=1    # the same over the delay line
    python benchmarks/link.py --adaptive --corpus python --write eval.every=1   # on the standard library's sources

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
docs/results/link-and-peers.md between the link markers. Needs root, ``ip`` and ``tc``; otherwise the script says why,
prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
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

from adloco.config.input import layered

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results" / "link-and-peers.md"
RESULTS = ROOT / "benchmarks" / "results" / "link.json"
BEGIN, END = "<!-- link:begin -->", "<!-- link:end -->"
DEFAULT_OUT = ROOT / "runs" / "link"
SUBNET = "10.77.0"
TBF_LATENCY = "400ms"  # how long a packet may wait in the bucket's queue before tbf drops it (not a delay)

# Issue 14: with H = 10, DiLoCo's time to the target at 50 ms round trip is at most 1.15x its time at ~0 ms.
LATENCY_TARGET = 1.15

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
    fp4 = "codec.name=fp4-e2m1"
    table = {
        "ddp": ["method=ddp", workers],
        "diloco": ["method=diloco", workers],
        "streaming-fp4": ["method=streaming", fp4, workers],
        # One trainer per rank, merged pairwise every merge.every rounds: the same workers as the others.
        "adloco": ["method=adloco", f"trainers={ranks}", "workers=1"],
        # The gentler norm test of docs/adloco.md (batches grow later), not in the default list.
        "adloco-eta2.5": [
            "method=adloco",
            f"trainers={ranks}",
            "workers=1",
            "batch.statistics.eta=2.5",
            "batch.statistics.ema=0.5",
        ],
    }
    for codec, codec_overrides in CODECS.items():
        for h in DILOCO_H:
            table[diloco_name(codec, h)] = ["method=diloco", workers, f"sync_every={h}", *codec_overrides]
        # Issue 16's comparison: the time-aware controller on one trainer of all ranks, smoothed statistics.
        for h in ADLOCO_H:
            adloco = ["method=adloco", "trainers=1", workers, "batch.statistics.ema=0.5", f"sync_every={h}"]
            table[adloco_name(codec, h)] = [*adloco, *codec_overrides]
    return table[method]


# Issue 16: AdLoCo reaches DDP's final loss in at most this fraction of the time of the best DiLoCo (H in DILOCO_H)
# that exchanges with the same codec, at every rate and rank count. AdLoCo runs at its default H (10) and at
# DiLoCo's best H on these links (50), and the better of the two counts.
DILOCO_H = (10, 20, 50)
ADLOCO_H = (10, 50)
TARGET_VS_BEST_DILOCO = 0.67
CODECS = {"fp32": [], "fp4": ["codec.name=fp4-e2m1"]}


def diloco_name(codec: str, h: int) -> str:
    """``diloco-h20``, ``diloco-fp4-h50``, ..."""
    return f"diloco{'-fp4' if codec == 'fp4' else ''}-h{h}"


def adloco_name(codec: str, h: int) -> str:
    """``adloco-1t`` (one trainer of all ranks, H = 10), ``adloco-1t-fp4-h50``, ..."""
    return f"adloco-1t{'-fp4' if codec == 'fp4' else ''}{'' if h == 10 else f'-h{h}'}"


ADAPTIVE_METHODS = (
    "ddp",
    *(diloco_name(c, h) for c in CODECS for h in DILOCO_H),
    *(adloco_name(c, h) for c in CODECS for h in ADLOCO_H),
)
METHODS = ("ddp", "diloco", "streaming-fp4", "adloco", "adloco-eta2.5", *ADAPTIVE_METHODS[1:])
DEFAULT_METHODS = ("ddp", "diloco", "streaming-fp4", "adloco")


def portable(overrides: Sequence[str]) -> list[str]:
    """Overrides as stored with a result: paths inside the checkout relative to it (no machine's path kept)."""
    return [o.replace(f"{ROOT}/", "") for o in overrides]


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
    """Rank namespaces joined through a hub namespace, every rank's upload and download limited to ``rate_mbit``.

    ``rtt_ms`` is None for the bridge with tbf buckets (a near-zero round trip), else the round-trip time the
    delay line adds (benchmarks/delay_line.py).
    """

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    addresses: tuple[str, ...]
    hub: str
    rate_mbit: int
    rtt_ms: float | None = None

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


def _layout(ranks: int, prefix: str) -> tuple[tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]:
    """Rank namespaces, the hub namespace, each rank's interface and address (rank k at SUBNET.k+1)."""
    if not 2 <= ranks <= 8:
        raise LinkError(f"ranks must be between 2 and 8, got {ranks}")
    names = tuple(f"{prefix}ns{k}" for k in range(ranks))
    interfaces = tuple(f"{prefix}v{k}" for k in range(ranks))
    return names, f"{prefix}hub", interfaces, tuple(f"{SUBNET}.{k + 1}" for k in range(ranks))


@contextmanager
def namespace_link(rate_mbit: int, ranks: int = 2, prefix: str = "adl") -> Iterator[Link]:
    """Create the namespaces, bridge and limited veth pairs; always remove them on the way out.

    Nothing is created in the caller's own namespace: every interface is made directly inside its namespace.
    """
    names, hub, interfaces, addresses = _layout(ranks, prefix)
    bridge = f"{prefix}br"
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


DELAY_LINE = ROOT / "benchmarks" / "delay_line.py"
# A 50 ms link at 1 Gbit/s holds 6.25 MB in flight; the kernel's default socket buffers (4 MB at most for
# sending) would cap TCP below the rate, so every rank namespace gets the maxima one sets on a long fat link.
TCP_BUFFERS = {"net.ipv4.tcp_rmem": "4096 131072 33554432", "net.ipv4.tcp_wmem": "4096 16384 33554432"}
SLOW_START_AFTER_IDLE = "net.ipv4.tcp_slow_start_after_idle"


@contextmanager
def delay_link(rate_mbit: int, rtt_ms: float, ranks: int = 2, prefix: str = "adl") -> Iterator[Link]:
    """Rank namespaces joined by the userspace delay line: ``rate_mbit`` each way, ``rtt_ms`` round trip.

    The delay line runs in the hub namespace and creates one TUN device per rank there; each device is then moved
    into its rank's namespace. Everything is removed on the way out, the delay line stopped.
    """
    names, hub, interfaces, addresses = _layout(ranks, prefix)
    _delete_namespaces([*names, hub])
    line: subprocess.Popen | None = None
    try:
        for name in (*names, hub):
            _run(["ip", "netns", "add", name])
        line = subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, str(DELAY_LINE), "--devices", ",".join(interfaces),
             "--addresses", ",".join(addresses), "--rate-mbit", str(rate_mbit), "--delay-ms", str(rtt_ms / 2)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _await_ready(line)
        for rank in range(ranks):
            ns, dev = names[rank], interfaces[rank]
            _run(["ip", "-n", hub, "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{addresses[rank]}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            for key, value in TCP_BUFFERS.items():
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])
        yield Link(names, interfaces, addresses, hub, rate_mbit, rtt_ms)
    finally:
        if line is not None:
            _stop_delay_line(line)
        _delete_namespaces([*names, hub])


def _await_ready(line: subprocess.Popen, timeout_s: float = 30.0) -> None:
    assert line.stdout is not None
    ready, _, _ = select.select([line.stdout], [], [], timeout_s)
    if not ready or line.stdout.readline().strip() != "ready":
        line.kill()
        _, err = line.communicate(timeout=10)
        raise LinkError(f"the delay line did not start: {err.strip()[-300:] or 'no answer in time'}")


def _stop_delay_line(line: subprocess.Popen) -> None:
    """Close the delay line's input (it exits and prints its counts); kill it if it does not."""
    try:
        out, err = line.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        line.kill()
        out, err = line.communicate()
    if line.returncode not in (0, -signal.SIGKILL):
        print(f"  delay line exited {line.returncode}: {err.strip()[-300:]}", flush=True)
    elif out.strip():
        print(f"  delay line: {out.strip().splitlines()[-1]}", flush=True)


def set_slow_start_after_idle(link: Link, enabled: bool) -> None:
    """Linux's default (on) shrinks TCP's window back to 10 segments after an idle spell longer than one RTO."""
    for ns in link.namespaces:
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{SLOW_START_AFTER_IDLE}={int(enabled)}"])


# One server and one client for every probe of a link; each prints its figure on stdout.
#   server echo: returns every byte | ack SIZE: one byte back per SIZE bytes received | count: bytes, seconds
#   client ping COUNT: median one-byte round trip (ms) | bursts SIZE IDLE COUNT: median ms per acknowledged
#   burst after IDLE s of silence | stream SIZE: sends SIZE bytes and closes
_PROBE_SERVER = """
import socket, sys, time
address, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((address, port))
server.listen(1)
server.settimeout(60)
print("ready", flush=True)
conn, _ = server.accept()
conn.settimeout(60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
size = int(sys.argv[4]) if mode == "ack" else 0
total, pending, first = 0, 0, None
while True:
    chunk = conn.recv(1 if mode == "echo" else 1 << 20)
    if not chunk:
        break
    first = first if first is not None else time.perf_counter()
    total, pending = total + len(chunk), pending + len(chunk)
    if mode == "echo":
        conn.sendall(chunk)
    elif mode == "ack" and pending >= size:
        pending -= size
        conn.sendall(b"x")
if mode == "count":
    print(total, time.perf_counter() - first, flush=True)
"""

_PROBE_CLIENT = """
import socket, statistics, sys, time
address, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 30
while True:
    try:
        sock = socket.create_connection((address, port), timeout=60)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "stream":
    sock.sendall(bytes(int(sys.argv[4])))
    sock.close()
    raise SystemExit(0)
payload, idle, count = (b"x", 0.0, int(sys.argv[4])) if mode == "ping" else (
    bytes(int(sys.argv[4])), float(sys.argv[5]), int(sys.argv[6]))
times = []
for _ in range(count):
    time.sleep(idle)
    start = time.perf_counter()
    sock.sendall(payload)
    if sock.recv(1) != b"x":
        raise SystemExit("no answer")
    times.append(time.perf_counter() - start)
print(statistics.median(times) * 1e3, flush=True)
"""


def _probe(link: Link, src: int, dst: int, port: int, server: list[str], client: list[str]) -> tuple[str, str]:
    """Run the probe server in ``dst``'s namespace and the client in ``src``'s; both their outputs."""
    where = [link.addresses[dst], str(port)]
    listener = subprocess.Popen(
        [*link.exec_prefix(dst), sys.executable, "-c", _PROBE_SERVER, *where, *server],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        if listener.stdout is None or listener.stdout.readline().strip() != "ready":
            raise LinkError(f"probe server did not start: {listener.stderr.read() if listener.stderr else ''}")
        done = subprocess.run(
            [*link.exec_prefix(src), sys.executable, "-c", _PROBE_CLIENT, *where, *client],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if done.returncode != 0:
            raise LinkError(f"probe client failed: {done.stderr.strip()[-300:]}")
        out, err = listener.communicate(timeout=60)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.communicate()
    if listener.returncode != 0:
        raise LinkError(f"probe server failed: {err.strip()[-300:]}")
    return out.strip(), done.stdout.strip()


def measure_rtt(link: Link, count: int = 20, port: int = 29700, src: int = 0, dst: int = 1) -> float:
    """Median round-trip time in ms of a one-byte TCP echo from rank ``src``'s namespace to rank ``dst``'s."""
    return float(_probe(link, src, dst, port, ["echo"], ["ping", str(count)])[1])


def measure_burst(
    link: Link, megabytes: int = 4, idle_s: float = 0.5, count: int = 5, port: int = 29650, src: int = 0, dst: int = 1
) -> float:
    """Median ms to deliver ``megabytes`` after ``idle_s`` of silence on one TCP connection: a DiLoCo exchange."""
    size = str(megabytes << 20)
    return float(_probe(link, src, dst, port, ["ack", size], ["bursts", size, str(idle_s), str(count)])[1])


def measure_rate(link: Link, megabytes: int = 8, port: int = 29600, src: int = 0, dst: int = 1) -> float:
    """Mbit/s achieved by one TCP stream from rank ``src``'s namespace to rank ``dst``'s (counted at the receiver)."""
    counted, _ = _probe(link, src, dst, port, ["count"], ["stream", str(megabytes << 20)])
    try:
        received, seconds = counted.split()
    except ValueError as error:
        raise LinkError(f"rate probe failed: {counted!r}") from error
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
                    [*link.exec_prefix(rank), sys.executable, "-m", "adloco", "train", *layered(overrides)],
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
        "exchanges": sum(int(r.get("exchanges") or 0) for r in rounds),  # rank 0's blocking exchanges
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
        delay = "" if link.rtt_ms is None else f"-{link.rtt_ms:g}ms"
        name = f"{method}-{link.rate_mbit}mbit{delay}-{ranks}ranks"
        settings = [*COMMON, *method_overrides(method, ranks), f"total_tokens={tokens}", f"seed={args.seed}"]
        settings += args.extra
        overrides = [*settings, f"run.root={root}", f"run.name={name}"]  # the results keep only the settings
        target = results["ddp"]["val_loss"] if method != "ddp" else None
        metrics = root / name / "metrics.jsonl"
        tail = MetricsTail(metrics)
        old = _read(metrics) if args.reuse and metrics.exists() and _same_run(root / name, settings) else []
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
            results[method] = {"error": str(error), "overrides": portable(settings)}
            if method == "ddp":
                break
            continue
        finally:
            port += 1  # a fresh port per job: the previous store's socket may linger in TIME_WAIT
        results[method] = {
            "overrides": portable(settings),
            "reused": reuse,
            "stopped_at_target": not result["finished"],
        }
        results[method].update(result)
        results[method]["wall_seconds"] = time.monotonic() - started
        r = results[method]
        reached_text = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.1f} s"
        print(f"  {name}: val {r['val_loss']:.4f} after {r['seconds']:.1f} s, target {reached_text}", flush=True)
    return results


def _same_run(run_dir: Path, settings: list[str]) -> bool:
    """Whether a run left in ``run_dir`` had these settings' budget, seed and corpus (--reuse must not mix them)."""
    import yaml

    from adloco import build_config

    path = run_dir / "config.yaml"
    if not path.exists():
        return False
    old = yaml.safe_load(path.read_text()) or {}
    new = build_config(overrides=settings)
    same_data = (old.get("data") or {}).get("dataset") == new.data.dataset
    return old.get("total_tokens") == new.total_tokens and old.get("seed") == new.seed and same_data


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


def rate_table(title: str, results: dict[str, Any]) -> str:
    """Markdown table of one link's runs under a bold ``title``."""
    target = results.get("ddp", {}).get("val_loss")
    lines = [
        f"**{title}**; target = DDP's final val loss " + (f"{target:.4f}" if target is not None else "(DDP failed)"),
        "",
        "| method | tokens run | val loss at end | training s | comm s | exchanges | bytes sent | time to target "
        "| tokens to target | speed-up vs DDP | vs DiLoCo |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    # DiLoCo at its default H (10) is the reference column, named diloco-h10 in the --adaptive comparison.
    diloco = results.get("diloco", results.get("diloco-h10", {}))
    base = {"ddp": results.get("ddp", {}).get("time_to_target"), "diloco": diloco.get("time_to_target")}
    for method, r in results.items():
        if "error" in r:
            lines.append(f"| {method} | — | failed: {r['error'][:80]} | | | | | | | | |")
            continue
        t = r["time_to_target"]
        vs = [_ratio(base[m] / t if t and base[m] else None) for m in ("ddp", "diloco")]
        to_target = "—" if r["tokens_to_target"] is None else f"{r['tokens_to_target']:,}"
        run = f"{r['tokens']:,}" + (" (stopped)" if r.get("stopped_at_target") else "")
        reached = "not reached" if t is None else f"{t:.1f} s"
        lines.append(
            f"| {method} | {run} | {r['val_loss']:.4f} | {r['seconds']:.1f} | {r['comm_seconds']:.1f} "
            f"| {r.get('exchanges', 0):,} | {r['bytes'] / 1e6:,.1f} MB | {reached} "
            f"| {to_target} | {vs[0]} | {vs[1]} |"
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


def _provenance(report: dict[str, Any]) -> str:
    """When, with what command and versions, on which machine."""
    v = report["versions"]
    return (
        f"Measured {report['date']} with `{report['command']}`: adloco {v['adloco']}, torch {v['torch']}, "
        f"Python {v['python']}; {report['machine']}."
    )


def _stopped_runs_head(report: dict[str, Any], links: str) -> str:
    """Provenance and budgets of runs with one thread per rank, stopped at the target; then what ``links`` were."""
    return (
        f"{_provenance(report)} One thread per rank, seed {report['seed']}; DDP {report['ddp_tokens']:,} tokens, "
        f"the others up to {report['other_tokens']:,} (stopped once they reach the target). {links}"
    )


def markdown(report: dict[str, Any]) -> str:
    """The section docs/results/link-and-peers.md shows: provenance, one table per rate, the targets."""
    head = (
        f"{_provenance(report)} {report['ranks']} ranks × 1 thread, seed {report['seed']}; "
        f"DDP {report['ddp_tokens']:,} tokens, the others up to {report['other_tokens']:,}"
        + (" (stopped once they reach the target)." if not report["run_to_budget"] else ".")
    )
    tables = [
        rate_table(f"{rate} Mbit/s tbf (measured {r['measured_mbit']:.0f} Mbit/s rank 0 → rank 1)", r["results"])
        for rate, r in report["rates"].items()
    ]
    return "\n\n".join([head, *tables, targets_text(report.get("targets"))])


def parse_links(text: str) -> list[tuple[int, float]]:
    """``"100@0,100@50"`` -> [(100, 0.0), (100, 50.0)]: rate in Mbit/s @ round-trip time in ms."""
    links = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        rate, sep, rtt = part.partition("@")
        try:
            link = (int(rate), float(rtt))
        except ValueError:
            raise ValueError(f"--links wants RATE@RTT entries such as 100@50, got {part!r}") from None
        if not sep or link[0] <= 0 or link[1] < 0:
            raise ValueError(f"--links wants RATE@RTT with a positive rate and RTT >= 0, got {part!r}")
        links.append(link)
    return links


def latency_checks(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """DiLoCo's time to the target at each delayed link against the same rate and ranks at ~0 ms."""
    base = {(r["ranks"], r["rate_mbit"]): r for r in runs if r["rtt_ms"] == 0}
    checks = []
    for run in runs:
        zero = base.get((run["ranks"], run["rate_mbit"]))
        if run["rtt_ms"] == 0 or zero is None:
            continue
        slow = run["results"].get("diloco", {}).get("time_to_target")
        fast = zero["results"].get("diloco", {}).get("time_to_target")
        ratio = slow / fast if slow and fast else None
        checks.append({"ranks": run["ranks"], "rate_mbit": run["rate_mbit"], "rtt_ms": run["rtt_ms"],
                       "ratio": ratio, "met": ratio is not None and ratio <= LATENCY_TARGET})  # fmt: skip
    return checks


def latency_markdown(report: dict[str, Any]) -> str:
    """The latency section of docs/results/link-and-peers.md: one table per (ranks, rate, RTT), then the target."""
    head = _stopped_runs_head(report, "Every link is the delay line, the ~0 ms rows included.")
    tables = []
    for run in report["runs"]:
        title = _link_title(run)
        burst = run["burst_ms"]
        note = (
            f"A 4 MB burst after 0.5 s idle takes {burst['slow_start']:.0f} ms with the kernel's slow start after "
            f"idle and {burst['kept_window']:.0f} ms without it (as in these runs)."
        )
        tables.append(rate_table(title, run["results"]) + "\n\n" + note)
    lines = [f"Target: DiLoCo's time to the target at 50 ms RTT ≤ {LATENCY_TARGET:g}× its time at ~0 ms.", ""]
    for check in report["checks"]:
        figure = "target not reached" if check["ratio"] is None else f"{check['ratio']:.2f}×"
        verdict = "met" if check["met"] else "not met"
        lines.append(
            f"- {check['ranks']} ranks, {check['rate_mbit']} Mbit/s, {check['rtt_ms']:g} ms: **{verdict}** ({figure})"
        )
    return "\n\n".join([head, *tables, "\n".join(lines)])


@contextmanager
def measured_link(ranks: int, rate: int, rtt: float | None) -> Iterator[tuple[Link, dict[str, Any]]]:
    """The tbf bridge (``rtt`` None) or the delay line, and what was measured on it before the runs."""
    if rtt is None:
        print(f"link at {rate} Mbit/s, {ranks} ranks", flush=True)
        with namespace_link(rate, ranks) as link:
            measured = measure_rate(link, megabytes=max(4, min(64, rate // 8)))
            print(f"  measured {measured:.1f} Mbit/s", flush=True)
            yield link, {"ranks": ranks, "rate_mbit": rate, "measured_mbit": measured}
        return
    print(f"delay line at {rate} Mbit/s, {rtt:g} ms RTT, {ranks} ranks", flush=True)
    with delay_link(rate, rtt, ranks) as link:
        measured_rtt = measure_rtt(link)
        measured = measure_rate(link, megabytes=max(4, min(64, rate // 8)))
        burst = {}
        for enabled in (True, False):  # the kernel's default first; the runs go without it
            set_slow_start_after_idle(link, enabled)
            burst["slow_start" if enabled else "kept_window"] = measure_burst(link, port=29650 + enabled)
        print(
            f"  measured {measured:.1f} Mbit/s, {measured_rtt:.2f} ms round trip; 4 MB after 0.5 s idle: "
            f"{burst['slow_start']:.0f} ms, {burst['kept_window']:.0f} ms keeping the window",
            flush=True,
        )
        yield link, {"ranks": ranks, "rate_mbit": rate, "rtt_ms": rtt, "measured_mbit": measured,
                     "measured_rtt_ms": measured_rtt, "burst_ms": burst}  # fmt: skip


def run_links(args: argparse.Namespace, links: Sequence[tuple[int, float | None]], report: dict[str, Any]) -> None:
    """Every method on every link (rate, RTT or None for tbf) and rank count; the runs go into ``report``."""
    report["runs"] = []
    for ranks in args.ranks:
        for rate, rtt in links:
            with measured_link(ranks, rate, rtt) as (link, run):
                run["results"] = run_rate(link, args, args.out)
            report["runs"].append(run)


def run_latency(args: argparse.Namespace, links: list[tuple[int, float]], report: dict[str, Any]) -> None:
    """Every method over the delay line, for every rank count and (rate, RTT), with issue 14's target."""
    run_links(args, links, report)
    report["checks"] = latency_checks(report["runs"])


def _fastest(results: dict[str, Any], names: Sequence[str]) -> tuple[str | None, float | None]:
    """The run among ``names`` that reached the target soonest, and its time; (None, None) if none did."""
    reached = {n: results[n]["time_to_target"] for n in names if (results.get(n) or {}).get("time_to_target")}
    if not reached:
        return None, None
    best = min(reached, key=reached.__getitem__)
    return best, reached[best]


def adaptive_checks(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link and codec: the fastest AdLoCo run's time to the target over the fastest DiLoCo run's."""
    checks = []
    for run in runs:
        for codec in CODECS:
            adloco, adloco_t = _fastest(run["results"], [adloco_name(codec, h) for h in ADLOCO_H])
            diloco, diloco_t = _fastest(run["results"], [diloco_name(codec, h) for h in DILOCO_H])
            ratio = adloco_t / diloco_t if adloco_t and diloco_t else None
            checks.append({"ranks": run["ranks"], "rate_mbit": run["rate_mbit"], "rtt_ms": run.get("rtt_ms"),
                           "codec": codec,
                           "adloco": adloco, "adloco_seconds": adloco_t, "diloco": diloco,
                           "diloco_seconds": diloco_t, "ratio": ratio,
                           "met": ratio is not None and ratio <= TARGET_VS_BEST_DILOCO})  # fmt: skip
    return checks


def _check_figure(check: dict[str, Any]) -> str:
    if check["adloco"] is None:
        return "AdLoCo did not reach the target"
    if check["diloco"] is None:
        return f"{check['adloco']} {check['adloco_seconds']:.1f} s; no DiLoCo run reached the target"
    return (
        f"{check['adloco']} {check['adloco_seconds']:.1f} s against {check['diloco']} "
        f"{check['diloco_seconds']:.1f} s: {check['ratio']:.2f}×"
    )


def _link_name(run: dict[str, Any]) -> str:
    """``2 ranks, 100 Mbit/s`` on a tbf link, ``2 ranks, 100 Mbit/s, 50 ms RTT`` on the delay line."""
    rtt = run.get("rtt_ms")
    return f"{run['ranks']} ranks, {run['rate_mbit']} Mbit/s" + ("" if rtt is None else f", {rtt:g} ms RTT")


def _link_title(run: dict[str, Any]) -> str:
    """A table's title: the link and what was measured on it."""
    measured = f"{run['measured_mbit']:.0f} Mbit/s"
    if run.get("rtt_ms") is not None:
        measured += f" and {run['measured_rtt_ms']:.1f} ms rank 0 → rank 1"
    return f"{_link_name(run)} (measured {measured})"


def _corpus_text(report: dict[str, Any]) -> str:
    corpus = report.get("corpus")
    if corpus is None:
        return ""
    return (
        f" Corpus: {corpus['corpus']} of Python {corpus['python']} ({corpus['files']:,} files, "
        f"{corpus['characters'] / 1e6:.1f} M characters), the last 1 % for validation."
    )


def adaptive_markdown(report: dict[str, Any]) -> str:
    """The AdLoCo section of docs/results/link-and-peers.md: a table per link and rank count, then each run's target."""
    delayed = any(run.get("rtt_ms") is not None for run in report["runs"])
    links = "Every link is the delay line." if delayed else "tbf links as above."
    head = _stopped_runs_head(report, links + _corpus_text(report))
    tables = [rate_table(_link_title(run), run["results"]) for run in report["runs"]]
    lines = [
        f"Target: AdLoCo's time to DDP's final loss ≤ {TARGET_VS_BEST_DILOCO:g}× that of the best DiLoCo "
        f"(H in {', '.join(map(str, DILOCO_H))}) with the same codec; AdLoCo at H in "
        f"{', '.join(map(str, ADLOCO_H))}, the faster counts.",
        "",
    ]
    for check in report["checks"]:
        verdict = "met" if check["met"] else "not met"
        lines.append(f"- {_link_name(check)}, {check['codec']}: **{verdict}** ({_check_figure(check)})")
    return "\n\n".join([head, *tables, "\n".join(lines)])


def run_adaptive(args: argparse.Namespace, links: list[tuple[int, float | None]], report: dict[str, Any]) -> None:
    """DDP, DiLoCo at every H with and without fp4, and AdLoCo with both, on every link and rank count."""
    run_links(args, links, report)
    report["checks"] = adaptive_checks(report["runs"])


def outputs(adaptive: bool, delayed: bool, corpus: str | None) -> tuple[Path, tuple[str, str]]:
    """Default results file and doc markers of a comparison: the tbf or delay-line tables, AdLoCo's, per corpus."""
    if adaptive:
        stem, tag = "link_adloco" + ("_latency" if delayed else ""), "link-adloco" + ("-latency" if delayed else "")
    else:
        stem, tag = ("latency", "latency") if delayed else ("link", "link")
    if corpus is not None:
        stem, tag = f"{stem}_{corpus}", f"{tag}-{corpus}"
    return RESULTS.with_name(f"{stem}.json"), (f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->")


def corpus_overrides(corpus: str) -> tuple[list[str], dict[str, Any]]:
    """The data overrides of every run on ``corpus``, and what the corpus holds (for the report)."""
    import python_corpus

    path, info = python_corpus.build()
    # As in the suite: 1 % of 30 MB is still three times Tiny Shakespeare's validation split.
    return [f"data.dataset={path}", "data.val_fraction=0.01"], info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 100,1000; not with --links)")
    parser.add_argument("--ranks", default="2", help="ranks, one namespace each (2-4 sensible); a list with --links")
    parser.add_argument("--links", help="RATE@RTT list (Mbit/s @ ms), e.g. 100@0,100@50: the delay line, not tbf")
    parser.add_argument("--tokens", type=int, default=256_000, help="DDP's training tokens (default 256000)")
    parser.add_argument("--budget-factor", type=float, default=2.0, help="other methods' token cap / DDP's")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated, of " + ",".join(METHODS))
    parser.add_argument("--run-to-budget", action="store_true", help="do not stop a method at the target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds before a job is killed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run directories and logs")
    parser.add_argument("--json", type=Path, default=RESULTS, help="results file (default benchmarks/results/)")
    parser.add_argument("--write", action="store_true", help="put the tables into --doc between the link markers")
    parser.add_argument("--doc", type=Path, default=DOC, help="default docs/results/link-and-peers.md")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --out, run the rest")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="issue 16's comparison: AdLoCo against DiLoCo at every H, fp32 and fp4, for each of --ranks",
    )
    parser.add_argument(
        "--corpus",
        choices=["python"],
        help="train on another corpus than Tiny Shakespeare: 'python' is the standard library's .py sources "
        "(benchmarks/python_corpus.py); results, doc section and run folder get a suffix",
    )
    parser.add_argument("extra", nargs="*", help="further overrides for every run")
    args = parser.parse_args(argv)
    if args.adaptive and args.methods == ",".join(DEFAULT_METHODS):
        args.methods = ",".join(ADAPTIVE_METHODS)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    if args.rates is not None and args.links:
        parser.error("--rates and --links exclude each other: --links gives each link's rate")
    args.rates = args.rates or "100,1000"
    try:
        rates = [int(r) for r in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates wants integers in Mbit/s, got {args.rates!r}")
    if any(r <= 0 for r in rates):
        parser.error(f"--rates must be positive, got {args.rates!r}")
    try:
        args.ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks wants integers, got {args.ranks!r}")
    try:
        links = parse_links(args.links) if args.links else None
    except ValueError as error:
        parser.error(str(error))
    if not all(2 <= r <= 8 for r in args.ranks) or (links is None and not args.adaptive and len(args.ranks) != 1):
        parser.error(f"--ranks must be between 2 and 8 (a list only with --links or --adaptive), got {args.ranks}")
    default_json, markers = outputs(args.adaptive, links is not None, args.corpus)
    args.json = default_json if args.json == RESULTS else args.json
    if args.corpus is not None and args.out == DEFAULT_OUT:
        args.out = DEFAULT_OUT.with_name(f"link-{args.corpus}")  # --reuse must not take a run on another corpus
    if args.tokens <= 0 or args.budget_factor < 1:
        parser.error("--tokens must be positive and --budget-factor at least 1")
    if args.write and not (args.doc.exists() and all(m in args.doc.read_text() for m in markers)):
        parser.error(f"--write: {args.doc} has no {markers[0]} ... {markers[1]} markers")
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
        "ranks": args.ranks[0] if links is None and not args.adaptive else args.ranks,
        "seed": args.seed,
        "ddp_tokens": args.tokens,
        "other_tokens": int(args.tokens * args.budget_factor),
        "run_to_budget": args.run_to_budget,
    }
    if args.corpus is not None:
        corpus_path, report["corpus"] = corpus_overrides(args.corpus)
        args.extra = [*corpus_path, *args.extra]
    if links is None:
        report["tbf"] = {"burst": {str(r): burst_for(r) for r in rates}, "latency": TBF_LATENCY}
    if args.adaptive:
        specs = links if links is not None else [(rate, None) for rate in rates]
        return _measure_and_publish(lambda: run_adaptive(args, specs, report), adaptive_markdown, args, report, markers)
    if links is not None:
        return _measure_and_publish(lambda: run_latency(args, links, report), latency_markdown, args, report, markers)
    return _measure_and_publish(lambda: run_rates(args, rates, report), markdown, args, report, markers)


def run_rates(args: argparse.Namespace, rates: list[int], report: dict[str, Any]) -> None:
    """Every method at every rate on one rank count; the issue-6 targets at TARGET_RATE."""
    report["rates"] = {}
    for rate in rates:
        with measured_link(args.ranks[0], rate, None) as (link, run):
            results = run_rate(link, args, args.out)
        report["rates"][str(rate)] = {"measured_mbit": run["measured_mbit"], "results": results}
    if str(TARGET_RATE) in report["rates"]:
        report["targets"] = target_checks(report["rates"][str(TARGET_RATE)]["results"])


def _measure_and_publish(
    measure: Callable[[], None],
    render: Callable[[dict[str, Any]], str],
    args: argparse.Namespace,
    report: dict[str, Any],
    markers: tuple[str, str],
) -> int:
    """Run the measurements into ``report``, then store and print them (exit 1 when the link fails)."""
    try:
        measure()
    except LinkError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    publish(report, render(report), args.json, args.doc if args.write else None, markers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
