"""Run metrics: one JSON object per line in ``metrics.jsonl``, plus the console progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends records to ``metrics.jsonl``; on resume, records after the checkpoint's round are dropped."""

    def __init__(self, path: Path, resume_round: int | None = None) -> None:
        self.path = path
        if resume_round is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if _round_of(line) <= resume_round]
            path.write_text("".join(line + "\n" for line in kept))
        self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

    def write(self, kind: str, **fields: Any) -> None:
        self.handle.write(json.dumps(_clean({"kind": kind, **fields})) + "\n")

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def _round_of(line: str) -> float:
    try:
        return json.loads(line).get("round", -1)
    except json.JSONDecodeError:
        return math.inf


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
