"""Where a run's checkpoints are and which round each holds, read from their names alone (no torch: the run
directory is checked before torch is imported)."""

from __future__ import annotations

import re
from pathlib import Path

from adloco.errors import CheckpointError

# round_<n>.pt: one file written by rank 0; round_<n>/: a sharded checkpoint, one file per rank (DCP)
CHECKPOINT_NAME = re.compile(r"^round_(\d{6})(\.pt)?$")


def checkpoint_round(path: Path) -> int:
    """The round a checkpoint file or folder was written after."""
    match = CHECKPOINT_NAME.match(path.name)
    if match is None:
        raise ValueError(f"'{path.name}' is not a checkpoint name")
    return int(match.group(1))


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory`` (files and sharded folders), oldest first."""
    if not directory.is_dir():
        return []
    found = (p for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name))
    return sorted(found, key=lambda p: (checkpoint_round(p), p.name))


def check_resumable(run_dir: Path) -> None:
    """CheckpointError unless ``run_dir`` holds a checkpoint to resume from."""
    if not list_checkpoints(run_dir / "checkpoints"):
        raise CheckpointError(f"run directory '{run_dir}' has no checkpoint to resume from")
