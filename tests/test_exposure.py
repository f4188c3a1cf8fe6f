"""Every socket adloco listens on in a loopback job is bound to loopback: a real 2-rank torchrun job, inspected
while it runs.

The torchrun launcher itself (torch's code, not adloco's) runs the rendezvous TCPStore, which torch binds to
every interface whatever --master_addr says; the test pins that down as the one known exception, so that a
change on either side shows up. docs/distributed.md says how to keep that port off the network."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.comm.test_distributed import BASE, _env, _free_port
from tests.conftest import process_tree

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

LOOPBACK = {"127.0.0.1", "::1"}


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} ("0100007F:1F90") in the usual notation, without the port."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    # The kernel prints each 32-bit word in host byte order (little-endian here).
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text.removeprefix("::ffff:") if text.startswith("::ffff:") and "." in text else text


def _listening_sockets() -> dict[str, str]:
    """inode -> "address:port" of every listening TCP socket on this machine."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                found[fields[9]] = f"{_address(fields[1])}:{int(fields[1].rsplit(':', 1)[1], 16)}"
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            with_target = os.readlink(fd) if fd.is_symlink() else ""
            if with_target.startswith("socket:["):
                inodes.add(with_target[len("socket:[") : -1])
    except OSError:  # the process ended while we looked
        pass
    return inodes


@pytest.mark.process
def test_a_loopback_torchrun_job_listens_on_loopback_only(tmp_path):
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "adloco",
        "train",
        *BASE,
        "method=diloco",
        "workers=2",
        "sync_every=4",
        "total_tokens=4096",
        "run.trackers=[]",
        f"run.root={tmp_path}",
    ]
    job = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen: dict[str, str] = {}  # inode -> address of every listening socket a rank (adloco) held at some point
    launcher: dict[str, str] = {}  # the same for the torchrun launcher process
    ranks_seen = 0
    deadline = time.monotonic() + 240
    try:
        while job.poll() is None and time.monotonic() < deadline:
            listening = _listening_sockets()
            tree = process_tree(job.pid)
            ranks_seen = max(ranks_seen, len(tree) - 1)
            for pid in tree:
                for inode in _socket_inodes(pid) & listening.keys():
                    (launcher if pid == job.pid else seen)[inode] = listening[inode]
            time.sleep(0.05)
    finally:
        if job.poll() is None:
            job.kill()
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr.decode()[-2000:]
    assert ranks_seen >= 2, "the ranks were never seen running"
    assert seen, "no listening socket was seen: the job's sockets could not be inspected"
    # A rank caught between fork and exec still holds the launcher's sockets: those are the launcher's, not adloco's.
    exposed = sorted(
        address
        for inode, address in seen.items()
        if inode not in launcher and address.rsplit(":", 1)[0] not in LOOPBACK
    )
    assert not exposed, f"adloco listens beyond loopback: {exposed} (all: {sorted(seen.values())})"
    # torch's rendezvous store in the launcher: the master port, on the wildcard address (a known torch behaviour).
    assert {address.rsplit(":", 1)[1] for address in launcher.values()} <= {str(port)}
