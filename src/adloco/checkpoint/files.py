"""The one-file checkpoint format: ``round_<n>.pt``, the whole state written by rank 0 with ``torch.save``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from adloco.checkpoint.schema import stamped, upgraded
from adloco.checkpoint.store import atomic_write_bytes, record_checkpoint, sha256_of, write_failure
from adloco.errors import CheckpointError


def save_checkpoint(directory: Path, round_number: int, state: dict[str, Any], keep: int, *, kind: str) -> Path:
    """Write ``round_<n>.pt`` (the state after round n, counted from 1, of ``kind``: see ``schema``) atomically,
    record its checksum in the manifest, keep the newest ``keep``.

    The manifest is rewritten (atomically) only after the checkpoint itself is on disk, so a crash at
    any moment leaves a manifest that names only complete checkpoints.
    """
    buffer = io.BytesIO()
    torch.save(stamped({"round": round_number, **state}, kind), buffer)
    data = buffer.getvalue()
    path = directory / f"round_{round_number:06d}.pt"
    try:
        atomic_write_bytes(path, data)
    except OSError as error:
        raise write_failure(error, "checkpoint", path) from None
    record_checkpoint(
        directory, {"file": path.name, "round": round_number, "bytes": len(data), "sha256": sha256_of(data)}, keep
    )
    return path


def load_file(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """A checkpoint file read back and checked: present, intact (its ``sha256`` when given), adloco's, and
    brought up to this format version."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {error.strerror}") from None
    if sha256 is not None and sha256_of(data) != sha256:
        raise CheckpointError(f"checkpoint '{path}' is damaged (checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except Exception as error:  # torch raises many types for a damaged file
        raise CheckpointError(f"checkpoint '{path}' is damaged or not a checkpoint ({type(error).__name__})") from None
    return upgraded(state, f"checkpoint '{path}'")
