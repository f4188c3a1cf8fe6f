"""``metrics.jsonl`` read back: its records, and whether the file is damaged (a module light enough for
``adloco runs``, which reads many runs without loading torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adloco.errors import DataError

__all__ = ["metrics_damage", "read_metrics"]


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: Path, strict: bool = False) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a line that is not a JSON object (a torn last line) is skipped. With
    ``strict`` a damaged file (see ``metrics_damage``) is a DataError instead."""
    if strict:
        problem = metrics_damage(Path(path))
        if problem is not None:
            raise DataError(f"'{path}' is damaged: {problem}")
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    return [record for line in lines if line.strip() and (record := _record(line)) is not None]


def metrics_damage(path: Path) -> str | None:
    """What makes ``metrics.jsonl`` untrustworthy, None when it reads: bytes that are not UTF-8 text, or a line
    that is not a record (a last line without its line break is a write a crash cut short, not damage)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"it is not UTF-8 text (byte {error.start:,})"
    lines = text.split("\n")
    checked = lines if text.endswith("\n") else lines[:-1]  # split leaves '' after a final line break
    for number, line in enumerate(checked, start=1):
        record = _record(line) if line.strip() else {"kind": ""}
        if record is None or not isinstance(record.get("kind"), str):
            return f"line {number:,} is not a metrics record"
    return None
