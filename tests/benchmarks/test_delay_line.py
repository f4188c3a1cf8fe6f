"""benchmarks/delay_line.py: pacing arithmetic, packet parsing, and the round trip it adds between real namespaces."""

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"adloco_{name}_benchmark", _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


delay_line = _load("delay_line")
link = _load("link")


def _packet(size: int, gso_type: int = 0, gso_size: int = 0, dst: str = "10.77.0.2") -> bytes:
    """A virtio header, then an IPv4 header and a TCP header with timestamps (32 bytes), padded to ``size``."""
    header = delay_line.VNET_HEADER.pack(0, gso_type, 0, gso_size, 0, 0)
    ip = bytes([0x45]) + bytes(11) + socket.inet_aton("10.77.0.1") + socket.inet_aton(dst)
    tcp = bytes(12) + bytes([8 << 4]) + bytes(19)
    return header + ip + tcp + bytes(size - len(ip) - len(tcp))


def test_a_packet_crosses_upload_then_download_then_the_delay():
    # 1 MB/s: a 1000-byte packet takes 1 ms on each line; 20 ms one way.
    pacing = delay_line.Pacing(ranks=3, rate_bytes_per_s=1e6, delay_s=0.020, queue_s=0.005)
    assert pacing.deliver_at(0.0, src=0, dst=1, nbytes=1000) == pytest.approx(0.022)
    # Sent at once behind it: waits 1 ms for the upload, then leaves the download 1 ms after the first.
    assert pacing.deliver_at(0.0, src=0, dst=1, nbytes=1000) == pytest.approx(0.023)
    # Another rank's packet for the same destination queues at that download line, not at its own upload.
    assert pacing.deliver_at(0.0, src=2, dst=1, nbytes=1000) == pytest.approx(0.024)
    # An idle line starts from the packet's own time.
    assert pacing.deliver_at(1.0, src=0, dst=2, nbytes=1000) == pytest.approx(1.022)


def test_a_packet_beyond_the_upload_queue_is_dropped():
    pacing = delay_line.Pacing(ranks=2, rate_bytes_per_s=1e6, delay_s=0.0, queue_s=0.0025)
    due = [pacing.deliver_at(0.0, 0, 1, 1000) for _ in range(5)]
    # The 4th and 5th would wait 3 and 4 ms at the upload, past the 2.5 ms queue.
    assert due[:3] == pytest.approx([0.002, 0.003, 0.004]) and due[3:] == [None, None]


def test_an_unpaced_line_only_delays():
    pacing = delay_line.Pacing(ranks=2, rate_bytes_per_s=0.0, delay_s=0.025, queue_s=0.4)
    assert [pacing.deliver_at(2.0, 0, 1, 65536) for _ in range(3)] == [2.025] * 3


def test_wire_bytes_count_the_headers_of_every_segment_of_an_offloaded_packet():
    assert delay_line.wire_bytes(_packet(1000)) == 1000
    # 52 header bytes + 4000 of payload in 1448-byte segments: 3 segments, so two more copies of the headers.
    assert delay_line.wire_bytes(_packet(4052, gso_type=1, gso_size=1448)) == 4052 + 2 * 52
    assert delay_line.wire_bytes(_packet(52 + 1448, gso_type=1, gso_size=1448)) == 1500


def test_only_ipv4_packets_have_a_destination():
    assert delay_line.destination(_packet(100, dst="10.77.0.3")) == socket.inet_aton("10.77.0.3")
    ipv6 = delay_line.VNET_HEADER.pack(0, 0, 0, 0, 0, 0) + bytes([0x60]) + bytes(60)
    assert delay_line.destination(ipv6) is None
    assert delay_line.destination(delay_line.VNET_HEADER.pack(0, 0, 0, 0, 0, 0) + bytes([0x45])) is None


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--devices", "a", "--addresses", "10.0.0.1"], ["--devices", "a,b", "--addresses", "10.0.0.1"]):
        with pytest.raises(SystemExit) as exit_info:
            delay_line.main(argv)
        assert exit_info.value.code == 2
    assert "same number" in capsys.readouterr().err


_UNAVAILABLE = link.netns_unavailable() or (None if Path("/dev/net/tun").exists() else "/dev/net/tun is missing")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.process
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"delay line unavailable: {_UNAVAILABLE}")
def test_the_delay_line_adds_the_round_trip_it_is_asked_for_and_keeps_the_rate():
    with link.delay_link(100, 0.0, ranks=2, prefix="adlt3") as fast:
        base = link.measure_rtt(fast, count=10)
    with link.delay_link(100, 40.0, ranks=3, prefix="adlt3") as slow:
        assert {"adlt3ns0", "adlt3ns1", "adlt3ns2", "adlt3hub"} <= set(_namespaces().split())
        delayed = link.measure_rtt(slow, count=10, src=2, dst=0)
        rate = link.measure_rate(slow, megabytes=4)
    assert base < 10.0  # the userspace hop alone adds well under a millisecond on an idle machine
    assert 40.0 <= delayed < 40.0 + base + 10.0
    assert 20 < rate < 101  # paced at 100 Mbit/s; the floor only guards against a link that barely works
    assert "adlt3" not in _namespaces()
