"""Atomic, versioned checkpoints: θ and outer state per trainer, inner state and data cursor per worker."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
_NAME = re.compile(r"^round_(\d{6})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, reported as one line."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the new content, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(directory: Path, round_index: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``round_<n>.pt`` atomically and keep only the newest ``keep`` checkpoints."""
    import io

    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "round": round_index, **state}, buffer)
    path = directory / f"round_{round_index:06d}.pt"
    atomic_write_bytes(path, buffer.getvalue())
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except Exception as error:  # torch raises many types for a damaged file
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a checkpoint ({type(error).__name__})") from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"checkpoint '{path}' is not an adloco checkpoint")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {state['format_version']}, this adloco reads {FORMAT_VERSION}"
        )
    return state


def latest_checkpoint(directory: Path) -> dict[str, Any] | None:
    checkpoints = list_checkpoints(directory)
    return load_checkpoint(checkpoints[-1]) if checkpoints else None
