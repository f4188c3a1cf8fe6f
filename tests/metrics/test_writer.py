"""metrics.jsonl writer (resume truncation, tracker fan-out) and the memory report."""

import json
import mmap

from adloco.metrics import writer as metrics
from adloco.metrics.writer import MetricsWriter, memory_snapshot, read_metrics


def test_memory_snapshot_reads_resident_and_peak_memory():
    before = memory_snapshot()
    # A fresh anonymous mapping, not a bytearray: malloc may hand a bytearray pages that earlier tests freed and
    # left resident, and then the resident size does not grow.
    block = mmap.mmap(-1, 64 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page so that all 64 MiB become resident
    after = memory_snapshot()
    assert 10 < before["rss_mib"] <= before["peak_rss_mib"] + 1e-6
    assert after["rss_mib"] >= before["rss_mib"] + 48 and after["peak_rss_mib"] >= after["rss_mib"] - 1e-6
    assert "cuda_allocated_mib" not in after  # CPU: no device figures
    block.close()


def test_memory_snapshot_without_proc_falls_back_to_getrusage(monkeypatch):
    monkeypatch.setattr(metrics, "_proc_status_kib", lambda *keys: {})
    snapshot = memory_snapshot()
    assert snapshot["rss_mib"] is None and snapshot["peak_rss_mib"] > 10


class _Collect:
    def __init__(self):
        self.seen = []

    def record(self, kind, fields, step):
        self.seen.append((kind, fields.get("round"), step))

    def flush(self):
        pass

    def close(self):
        self.seen.append(("closed", None, None))


def test_writer_fans_out_and_drops_records_after_the_resume_round(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tracker = _Collect()
    writer = MetricsWriter(path, trackers=[tracker])
    for r in range(3):
        writer.write("round", round=r, step=4 * (r + 1), val_loss=float("nan"))
    writer.close()
    assert tracker.seen == [("round", 0, 4), ("round", 1, 8), ("round", 2, 12), ("closed", None, None)]
    assert read_metrics(path)[0]["val_loss"] == "nan"  # non-finite values stay valid JSON
    MetricsWriter(path, resume_round=0).close()
    assert [r["round"] for r in read_metrics(path)] == [0]


def test_a_run_counted_from_0_continues_in_rounds_counted_from_1(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": k, "round": r}) + "\n" for r in range(4) for k in ("step", "round")))
    with open(path, "a") as handle:
        handle.write(json.dumps({"kind": "note"}) + "\n")  # a record without a round is kept as it is
    MetricsWriter(path, resume_round=1, renumber=1).close()  # its checkpoint was written after round index 1
    assert [(r["kind"], r.get("round")) for r in read_metrics(path)] == [
        ("step", 1), ("round", 1), ("step", 2), ("round", 2), ("note", None)
    ]  # fmt: skip
