"""Run metrics: one JSON object per line in ``metrics.jsonl`` (fanned out to trackers), memory, progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from adloco.checkpoint import write_failure
from adloco.tracking import FanOut, Tracker

_MIB = 2**20


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and hands each one to every tracker.

    On resume, records after the checkpoint's round are dropped from the file (trackers purge their own copies).
    """

    def __init__(self, path: Path, resume_round: int | None = None, trackers: Sequence[Tracker] = ()) -> None:
        self.path = path
        try:
            if resume_round is not None and path.exists():
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
                kept = [line for line in lines if _round_of(line) <= resume_round]
                path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run
        except OSError as error:
            raise write_failure(error, "metrics", path) from None
        self.trackers = FanOut(trackers)

    def write(self, kind: str, **fields: Any) -> None:
        record = _clean({"kind": kind, **fields})
        try:
            self.handle.write(json.dumps(record) + "\n")
        except OSError as error:
            raise self._failed(error) from None
        self.trackers.record(kind, record)

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as error:
            raise self._failed(error) from None
        self.trackers.flush()

    def close(self) -> None:
        if not self.handle.closed:
            try:
                self.handle.close()
            except OSError as error:
                raise self._failed(error) from None
        self.trackers.close()

    def _failed(self, error: OSError) -> Exception:
        """A failed write (full disk) as one line. The file is closed now (its unwritten buffer is lost; a resume
        rewrites the records after the last checkpoint) so that closing it later cannot fail again."""
        with contextlib.suppress(OSError):
            self.handle.close()
        return write_failure(error, "metrics", self.path)


def _round_of(line: str) -> float:
    try:
        record = json.loads(line)
    except ValueError:
        return math.inf
    value = record.get("round", -1) if isinstance(record, dict) else math.inf
    return value if isinstance(value, int | float) and not isinstance(value, bool) else math.inf


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a line that is not a JSON object (a torn last line) is skipped."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    return [record for line in lines if line.strip() and (record := _record(line)) is not None]


def _proc_status_kib(*keys: str) -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found


def memory_snapshot(device: torch.device | None = None) -> dict[str, float | None]:
    """This process's memory in MiB: resident now and at peak, plus CUDA allocated now and at peak on ``device``.

    The peaks are since the process started or since the b_max probe last reset them. Without ``/proc`` the
    peak comes from ``getrusage`` and the current resident size is unknown (None).
    """
    status = _proc_status_kib("VmRSS", "VmHWM")
    if "VmHWM" in status:
        peak = status["VmHWM"] / 1024
    else:
        # ru_maxrss is KiB on Linux and bytes on macOS
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss / _MIB if sys.platform == "darwin" else maxrss / 1024
    out: dict[str, float | None] = {
        "rss_mib": round(status["VmRSS"] / 1024, 2) if "VmRSS" in status else None,
        "peak_rss_mib": round(peak, 2),
    }
    if device is not None and device.type == "cuda":
        out["cuda_allocated_mib"] = round(torch.cuda.memory_allocated(device) / _MIB, 2)
        out["cuda_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / _MIB, 2)
        out["cuda_reserved_mib"] = round(torch.cuda.memory_reserved(device) / _MIB, 2)
    return out


def make_progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )
