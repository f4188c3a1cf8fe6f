"""``adloco lighthouse``: torchft's Lighthouse, which forms the quorum of fault-tolerant replicas every round."""

from __future__ import annotations

import signal
import socket
import sys
import threading

from adloco.errors import ConfigError


def serve(host: str, port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> int:
    """Run the Lighthouse until SIGINT or SIGTERM; prints the address replicas give as
    ``fault_tolerance.lighthouse``."""
    if min_replicas < 1:
        raise ConfigError(f"--min-replicas: {min_replicas}; a quorum needs at least 1 replica")
    if not 0 <= port < 65536:
        raise ConfigError(f"--port: {port} is not a port number (0 to 65535)")
    if join_timeout_s < 0 or heartbeat_timeout_s <= 0:
        raise ConfigError("--join-timeout and --heartbeat-timeout are seconds: give a positive number")
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as error:
        raise ConfigError(f"adloco lighthouse needs torchft (pip install 'adloco[torchft]'): {error}") from None
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=round(join_timeout_s * 1000),
            heartbeat_timeout_ms=round(heartbeat_timeout_s * 1000),
        )
    except Exception as error:  # the port is taken, or the address is not this host's
        raise ConfigError(f"the lighthouse cannot listen on {bind}: {error}") from None
    listening = int(server.address().rsplit(":", 1)[1])
    shown = socket.gethostname() if host in ("::", "0.0.0.0", "") else host
    print(f"lighthouse listening on {bind} (port {listening}): replicas give fault_tolerance.lighthouse="
          f"http://{shown}:{listening}", flush=True)  # fmt: skip
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    print("lighthouse stopped", file=sys.stderr)
    return 0
