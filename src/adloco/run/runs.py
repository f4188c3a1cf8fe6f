"""``adloco runs``: what the run directories under a root hold, and the RUNNING / FAILED markers behind it.

A run's status is read from its files alone:

- **finished**: ``metrics.jsonl`` ends with a ``final`` record and ``final/`` exists (or export was off);
- **running**: ``RUNNING`` names a live process (pid and its start time, on this host);
- **failed**: ``FAILED`` holds the error that stopped the run, or nothing was ever checkpointed;
- **stopped at round N**: checkpoints but no final model, no live process (killed, interrupted, out of power).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from adloco.checkpoint.names import checkpoint_round, list_checkpoints
from adloco.errors import CheckpointError, ConfigError
from adloco.metrics.records import metrics_damage, read_metrics
from adloco.run.stopping import Stopped
from adloco.units import short_count

RUNNING_FILE = "RUNNING"
FAILED_FILE = "FAILED"


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its closing one
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def mark_running(run_dir: Path) -> None:
    """Write ``RUNNING`` (pid, host, start) for ``adloco runs``; a previous attempt's ``FAILED`` no longer holds."""
    marker = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "process_start": _process_start(os.getpid()),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(OSError):
        (run_dir / FAILED_FILE).unlink(missing_ok=True)
        (run_dir / RUNNING_FILE).write_text(json.dumps(marker) + "\n")


LOCK_FILE = ".lock"


@dataclass
class RunLock:
    """The one process training a run directory holds this: an exclusive ``flock`` on ``.lock`` plus ``RUNNING``.

    The kernel drops the flock when the process dies however it dies, so a lock is never stale; ``RUNNING`` is
    only what ``adloco runs`` and the error messages read. ``took_over`` describes a dead process's marker found
    on the way in.
    """

    run_dir: Path
    handle: Any
    took_over: str | None = None

    def release(self, error: BaseException | None) -> None:
        """Remove ``RUNNING`` (recording ``error`` in ``FAILED``), then let go of the lock."""
        mark_ended(self.run_dir, error)
        with contextlib.suppress(OSError):
            self.handle.close()


def lock_run(run_dir: Path) -> RunLock:
    """Take ``run_dir`` for this process or raise ConfigError naming the live process that has it."""
    try:
        handle = (run_dir / LOCK_FILE).open("a+")
    except OSError as error:
        raise ConfigError(f"run directory '{run_dir}' is not writable: {error.strerror}") from None
    marker = _read_marker(run_dir)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(f"run directory '{run_dir}' is being trained by {_describe_marker(marker)}") from None
    if marker is not None and marker.get("pid") != os.getpid() and _alive(marker):
        # A live process holding no flock: an older adloco, or one on another host of a shared file system.
        handle.close()
        raise ConfigError(f"run directory '{run_dir}' is being trained by {_describe_marker(marker)}")
    took_over = None
    if marker is not None:
        took_over = f"took over '{run_dir}' from {_describe_marker(marker)}, which is no longer running"
    mark_running(run_dir)
    return RunLock(run_dir, handle, took_over)


def _read_marker(run_dir: Path) -> dict[str, Any] | None:
    """``RUNNING``'s content; {} when it exists but cannot be read, None when there is none."""
    if not (run_dir / RUNNING_FILE).exists():
        return None
    try:
        marker = json.loads((run_dir / RUNNING_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _describe_marker(marker: dict[str, Any] | None) -> str:
    if not marker or not isinstance(marker.get("pid"), int):
        return "another process"
    host = f" on {marker['host']}" if marker.get("host") not in (None, socket.gethostname()) else ""
    started = f", started {marker['started']}" if marker.get("started") else ""
    return f"process {marker['pid']}{host}{started}"


def mark_ended(run_dir: Path, error: BaseException | None) -> None:
    """Remove ``RUNNING``; record an error (not a Ctrl-C or a stop signal, which only stop the run) in ``FAILED``."""
    with contextlib.suppress(OSError):
        (run_dir / RUNNING_FILE).unlink(missing_ok=True)
        if error is not None and not isinstance(error, KeyboardInterrupt | SystemExit | Stopped):
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            (run_dir / FAILED_FILE).write_text(f"{type(error).__name__}: {first_line}\n")


@dataclass
class RunSummary:
    """One row of ``adloco runs``."""

    name: str
    path: str
    method: str | None
    status: str
    tokens: int | None
    total_tokens: int | None
    rounds: int | None
    val_loss: float | None
    modified: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["modified"] = datetime.fromtimestamp(self.modified, timezone.utc).isoformat(timespec="seconds")
        return out


def _records(metrics: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records ``metrics.jsonl`` holds, and what damages it (None when nothing does, or it does not exist)."""
    if not metrics.exists():
        return [], None
    try:
        return read_metrics(metrics), metrics_damage(metrics)
    except OSError as error:  # a folder in its place, no permission
        return [], f"it cannot be read ({error.strerror})"


def _read_config(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, yaml.YAMLError, UnicodeDecodeError):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
    return {}


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _best_loss(values: Any) -> float | None:
    losses = [v for v in map(_finite, (values or {}).values()) if v is not None] if isinstance(values, dict) else []
    return min(losses) if losses else None


def _alive(marker: dict[str, Any]) -> bool:
    if marker.get("host") not in (None, socket.gethostname()):
        return True  # another machine's process cannot be checked from here: trust the marker
    pid = marker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    started = marker.get("process_start")
    now = _process_start(pid)
    return started is None or now is None or started == now


def _checkpoint_rounds(run_dir: Path) -> list[int]:
    return [checkpoint_round(p) for p in list_checkpoints(run_dir / "checkpoints")]


def _modified(run_dir: Path) -> float:
    times = [run_dir.stat().st_mtime]
    for path in (*run_dir.iterdir(), *(run_dir / "checkpoints").glob("*")):
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times)


def summarize_run(run_dir: Path) -> RunSummary:
    """Status, progress and loss of one run directory, from its files (damaged files are tolerated)."""
    config = _read_config(run_dir / "config.yaml")
    records, damage = _records(run_dir / "metrics.jsonl")
    rounds = [r for r in records if r.get("kind") == "round"]
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    last = rounds[-1] if rounds else {}
    method = config.get("method") if isinstance(config.get("method"), str) else None
    total = config.get("total_tokens") if isinstance(config.get("total_tokens"), int) else None
    tokens = last.get("tokens") if isinstance(last.get("tokens"), int) else None
    done_rounds = last["round"] if isinstance(last.get("round"), int) else None
    val_loss = None
    if final is not None:
        best = final.get("best_trainer")
        losses = final.get("val_loss") if isinstance(final.get("val_loss"), dict) else {}
        val_loss = _finite(losses.get(str(best))) if best is not None else None
        val_loss = val_loss if val_loss is not None else _best_loss(losses)
        tokens = final.get("tokens", tokens)
        done_rounds = final.get("rounds", done_rounds)
    else:
        evaluated = [r for r in rounds if _best_loss(r.get("val_loss")) is not None]
        val_loss = _best_loss(evaluated[-1]["val_loss"]) if evaluated else None

    save_final = (config.get("run") or {}).get("save_final", True) if isinstance(config.get("run"), dict) else True
    marker = _read_marker(run_dir)  # an unreadable one ({}) is treated as stale
    error = None
    checkpoints = _checkpoint_rounds(run_dir)
    if final is not None and ((run_dir / "final").is_dir() or not save_final):
        status = "finished"
    elif marker is not None and _alive(marker):
        status = "running"
    elif (run_dir / FAILED_FILE).exists():
        status = "failed"
        with contextlib.suppress(OSError, UnicodeDecodeError):
            error = (run_dir / FAILED_FILE).read_text().strip() or None
    elif checkpoints:
        status = f"stopped at round {checkpoints[-1]}"
    else:
        status = "failed"
        error = "stopped before its first checkpoint"
    if damage is not None:  # whatever the files say, the user must know the record of the run is not whole
        error = "; ".join(filter(None, (error, f"metrics.jsonl is damaged: {damage}")))
    return RunSummary(
        name=run_dir.name,
        path=str(run_dir),
        method=method,
        status=status,
        tokens=tokens,
        total_tokens=total,
        rounds=done_rounds,
        val_loss=val_loss,
        modified=_modified(run_dir),
        error=error,
    )


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "config.yaml").exists() or (path / "metrics.jsonl").exists())


def find_runs(root: Path) -> list[RunSummary]:
    """Every run directory directly under ``root`` (or ``root`` itself if it is one), newest first."""
    if not root.exists():
        raise CheckpointError(f"runs folder '{root}' does not exist")
    if not root.is_dir():
        raise CheckpointError(f"'{root}' is not a folder of runs")
    if _is_run_dir(root):
        candidates = [root]
    else:
        candidates = [p for p in root.iterdir() if not p.name.startswith(".") and _is_run_dir(p)]
    return sorted((summarize_run(p) for p in candidates), key=lambda s: s.modified, reverse=True)


def _count(n: int) -> str:
    # Three significant digits, as the progress bar shows them: 20,736 of 20,000 reads 20.7k/20k, not 21k/20k.
    return f"{n:,}" if n < 10_000 else short_count(n)


def _tokens_text(run: RunSummary) -> str:
    if run.tokens is None:
        return "-" if run.total_tokens is None else f"0/{_count(run.total_tokens)}"
    if not run.total_tokens:
        return _count(run.tokens)
    return f"{_count(run.tokens)}/{_count(run.total_tokens)}"


def runs_table(runs: list[RunSummary], root: Path) -> Any:
    """A rich table of ``runs``."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"runs under {root}", title_justify="left", box=box.SIMPLE_HEAD)
    for column, justify in (
        ("run", "left"),
        ("method", "left"),
        ("status", "left"),
        ("tokens", "right"),
        ("rounds", "right"),
        ("val loss", "right"),
        ("modified", "left"),
    ):
        # only the name and status may fold: the figures stay whole on a narrow terminal
        folds = column in ("run", "status")
        table.add_column(column, justify=justify, no_wrap=not folds, overflow="fold", min_width=12 if folds else None)
    colours = {"finished": "green", "running": "cyan", "failed": "red"}
    for run in runs:
        status = run.status + (f" ({run.error})" if run.error else "")
        table.add_row(
            Text(run.name),  # Text, not markup: names and errors may hold brackets
            run.method or "?",
            Text(status, style=colours.get(run.status, "yellow")),
            _tokens_text(run),
            "-" if run.rounds is None else str(run.rounds),
            "-" if run.val_loss is None else f"{run.val_loss:.4f}",
            datetime.fromtimestamp(run.modified).strftime("%m-%d %H:%M"),
        )
    return table
