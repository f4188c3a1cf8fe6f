"""Run metrics: one JSON object per line in ``metrics.jsonl`` (fanned out to trackers), memory, progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from adloco.checkpoint import write_failure
from adloco.errors import ConfigError
from adloco.metrics.records import read_metrics  # noqa: F401 - where the writer is, readers look first
from adloco.metrics.tracking import FanOut, Tracker
from adloco.models.precision import peak_flops
from adloco.units import duration, short_count

if TYPE_CHECKING:
    from adloco.config import RunConfig

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

    def __init__(
        self,
        path: Path,
        resume_round: int | None = None,
        trackers: Sequence[Tracker] = (),
        renumber: int = 0,
    ) -> None:
        """``renumber`` is added to the ``round`` of the records kept on resume (1 for a run written when rounds
        were counted from 0, so its records continue in today's numbering)."""
        self.path = path
        try:
            if resume_round is not None and path.exists():
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
                kept = [_renumbered(line, renumber) for line in lines if _round_of(line) <= resume_round]
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


def _renumbered(line: str, offset: int) -> str:
    if not offset:
        return line
    record = json.loads(line)
    if isinstance(record.get("round"), int):
        record["round"] += offset
    return json.dumps(record)


def _round_of(line: str) -> float:
    try:
        record = json.loads(line)
    except ValueError:
        return math.inf
    value = record.get("round", -1) if isinstance(record, dict) else math.inf
    return value if isinstance(value, int | float) and not isinstance(value, bool) else math.inf


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
    """The terminal's bar: short columns, so that it stays readable at 80 columns."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=12),
        TextColumn("{task.fields[tokens]}"),
        TimeRemainingColumn(compact=True),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )


@dataclass
class ProgressLine:
    """Plain progress records every ``every_s`` seconds, for logs and terminals that are not one (nohup, SLURM).

    ``emit`` receives each line; training sends it to train.log, and to stderr when stderr is not a terminal.
    """

    total: int
    every_s: float
    emit: Callable[[str], None]
    started_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def update(self, round_index: int, tokens: int, status: str, force: bool = False) -> None:
        """Emit a line if ``every_s`` has passed since the last one (or ``force``)."""
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        rate = (tokens - self.started_tokens) / max(now - self.started, 1e-9)
        left = f"ETA {duration((self.total - tokens) / rate)}" if rate > 0 and tokens < self.total else "ETA -"
        share = 100 * min(tokens, self.total) / self.total
        self.emit(
            f"round {round_index + 1} · tokens {min(tokens, self.total):,}/{self.total:,} ({share:.1f}%) · "
            f"{rate:,.0f} tok/s · {status} · {left}"
        )


class RunDisplay:
    """A run's progress: rich's bar on a terminal, plain lines when stderr is not one, and lines in ``log`` always.

    ``enabled`` (run.progress on rank 0) governs the console only; the log gets a line every ``every_s`` seconds.
    """

    def __init__(
        self, console: Console, description: str, total: int, done: int, enabled: bool, every_s: float, log: Callable
    ) -> None:
        terminal = console.is_terminal
        self.total = total
        self.bar = make_progress(console, enabled and terminal)

        def emit(line: str) -> None:
            log(line)
            if enabled and not terminal:
                console.print(line, markup=False, highlight=False, soft_wrap=True)

        self.lines = ProgressLine(total, every_s, emit, started_tokens=done)
        counted = f"{short_count(done)}/{short_count(total)}"
        self.task = self.bar.add_task(description, total=total, completed=min(done, total), tokens=counted, status="")

    def __enter__(self) -> RunDisplay:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)

    def show(self, round_index: int, tokens: int, status: str, force: bool = False) -> None:
        """Tokens trained so far (the true count, which may pass the budget by part of a step) and a status."""
        counted = f"{short_count(tokens)}/{short_count(self.total)}"
        self.bar.update(
            self.task, completed=min(tokens, self.total), tokens=counted, status=f"r{round_index + 1} {status}"
        )
        self.lines.update(round_index, tokens, status, force=force)


def job_peak_flops(run: RunConfig, precision: str, tf32: bool, device: torch.device, ranks: int) -> float | None:
    """The peak of the job's devices together (one per rank on CUDA; a CPU's run.peak_tflops is the machine's), or
    None when MFU is not reported; run.mfu=true without a known peak is refused. The peak depends on the
    ``precision`` the steps run in and on ``tf32`` matmuls."""
    if run.mfu is False:
        return None
    one = run.peak_tflops * 1e12 if run.peak_tflops else peak_flops(device, precision, tf32)
    if one is None and run.mfu:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
        raise ConfigError(f"run.mfu: the peak of {name} for {precision} is not known; give run.peak_tflops")
    return None if one is None else one * (ranks if device.type == "cuda" else 1)
