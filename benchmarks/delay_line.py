"""A userspace delay line between network namespaces: packets cross TUN devices, paced at a rate, held for a delay.

    python benchmarks/delay_line.py --devices adlv0,adlv1 --addresses 10.77.0.1,10.77.0.2 \\
        --rate-mbit 100 --delay-ms 25

``tc netem`` is missing from some kernels; this stands in for it. The process creates one TUN device per rank in
its own namespace and prints ``ready``; the caller then moves each device into its rank's namespace and gives it
the rank's address (benchmarks/link.py does all of that). Every IPv4 packet a rank sends is read here and written
into the TUN device of the rank that owns its destination address, after

- its rank's upload, then the destination's download, each a serial line at ``--rate-mbit`` (store and forward,
  like two tbf buckets around a switch), and
- ``--delay-ms``, the one-way delay (the round-trip time a ping sees is twice that).

The devices use the virtio header with TCP segmentation offload, so TCP hands over up to 64 KiB per read while
its congestion window still counts 1500-byte segments; the pacing counts every segment's headers. A packet that
would queue longer than ``--queue-ms`` at a rank's upload is dropped, as a bounded switch buffer would.

The process ends when its standard input closes (the caller died or is done), on SIGTERM, or after
``--max-seconds``.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HEADER = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
GSO_NONE = 0
MAX_PACKET = VNET_HEADER.size + 65536 + 4096


def open_tun(name: str) -> int:
    """A TUN device ``name`` (IPv4 packets with a virtio header, TCP offloads on) in this process's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def wire_bytes(packet: bytes) -> int:
    """Bytes the packet takes on a wire of 1500-byte frames: a TSO packet is many segments, each with its headers."""
    _, gso_type, _, gso_size, _, _ = VNET_HEADER.unpack_from(packet)
    start = VNET_HEADER.size
    size = len(packet) - start
    if gso_type == GSO_NONE or gso_size == 0 or size < 40:
        return size
    # The virtio header's hdr_len may cover more than the headers, so they are read from the packet itself:
    # IPv4 header length, then the TCP data offset.
    ip_header = (packet[start] & 0x0F) * 4
    headers = ip_header + (packet[start + ip_header + 12] >> 4) * 4
    segments = max(1, -(-(size - headers) // gso_size))
    return size + (segments - 1) * headers


def destination(packet: bytes) -> bytes | None:
    """The IPv4 destination address of a packet read from a device (None for anything but IPv4)."""
    start = VNET_HEADER.size
    if len(packet) < start + 20 or packet[start] >> 4 != 4:
        return None
    return packet[start + 16 : start + 20]


@dataclass
class Pacing:
    """When each packet reaches its destination: upload line, download line, then the one-way delay."""

    ranks: int
    rate_bytes_per_s: float
    delay_s: float
    queue_s: float
    upload_free: list[float] = field(default_factory=list)
    download_free: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.upload_free = [0.0] * self.ranks
        self.download_free = [0.0] * self.ranks

    def deliver_at(self, now: float, src: int, dst: int, nbytes: int) -> float | None:
        """The time a packet sent at ``now`` arrives, or None when the upload queue is full and it is dropped."""
        serial = nbytes / self.rate_bytes_per_s if self.rate_bytes_per_s > 0 else 0.0
        start = max(now, self.upload_free[src])
        if start - now > self.queue_s:
            return None
        self.upload_free[src] = start + serial
        self.download_free[dst] = max(self.upload_free[src], self.download_free[dst]) + serial
        return self.download_free[dst] + self.delay_s


def forward(fds: Sequence[int], addresses: Sequence[str], pacing: Pacing, deadline: float, control: int) -> dict:
    """Move packets between the devices until ``control`` closes or ``deadline``; counts of what happened."""
    owner = {socket.inet_aton(address): rank for rank, address in enumerate(addresses)}
    rank_of_fd = {fd: rank for rank, fd in enumerate(fds)}
    watched = [*fds, control]
    queue: list[tuple[float, int, int, bytes]] = []  # (due, order, destination fd, packet)
    counts = {"forwarded": 0, "dropped": 0, "unroutable": 0}
    order = 0
    while time.monotonic() < deadline:
        now = time.monotonic()
        # select takes a timeout in microseconds (poll's milliseconds would either spin or deliver late).
        ready, _, _ = select.select(watched, [], [], 0.2 if not queue else max(0.0, queue[0][0] - now))
        for fd in ready:
            if fd == control:
                if not os.read(control, 4096):
                    return counts
                continue
            now = time.monotonic()
            for packet in _drain(fd):
                dst = owner.get(destination(packet) or b"")
                if dst is None:
                    counts["unroutable"] += 1
                    continue
                due = pacing.deliver_at(now, rank_of_fd[fd], dst, wire_bytes(packet))
                if due is None:
                    counts["dropped"] += 1
                    continue
                heapq.heappush(queue, (due, order, fds[dst], packet))
                order += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, packet = heapq.heappop(queue)
            with _ignore_full_device():
                os.write(fd, packet)
                counts["forwarded"] += 1
    return counts


def _drain(fd: int, limit: int = 256) -> list[bytes]:
    packets = []
    for _ in range(limit):
        try:
            packets.append(os.read(fd, MAX_PACKET))
        except BlockingIOError:
            break
    return packets


class _ignore_full_device:
    """A device whose queue is full drops the packet, as a full NIC would; TCP sends it again."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, BlockingIOError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", required=True, help="TUN device names, one per rank, comma-separated")
    parser.add_argument("--addresses", required=True, help="each rank's IPv4 address, in the same order")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="upload and download rate; 0 = unpaced")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (round trip = twice this)")
    parser.add_argument("--queue-ms", type=float, default=400.0, help="longest wait at an upload before a drop")
    parser.add_argument("--max-seconds", type=float, default=6 * 3600.0, help="end after this long regardless")
    args = parser.parse_args(argv)
    devices = [d for d in args.devices.split(",") if d]
    addresses = [a for a in args.addresses.split(",") if a]
    if len(devices) != len(addresses) or len(devices) < 2:
        parser.error("--devices and --addresses need the same number (at least 2) of entries")
    if args.rate_mbit < 0 or args.delay_ms < 0 or args.queue_ms <= 0:
        parser.error("--rate-mbit and --delay-ms must be >= 0 and --queue-ms > 0")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    fds = [open_tun(name) for name in devices]
    pacing = Pacing(len(fds), args.rate_mbit * 1e6 / 8, args.delay_ms / 1e3, args.queue_ms / 1e3)
    print("ready", flush=True)
    counts = forward(fds, addresses, pacing, time.monotonic() + args.max_seconds, sys.stdin.fileno())
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
