"""Atomic, versioned checkpoints: θ and outer state per trainer, inner state and data cursor per worker."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

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


MANIFEST = "manifest.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(directory: Path) -> list[dict[str, Any]]:
    """Checkpoint entries (file, round, bytes, sha256), oldest first; empty if there is no readable manifest."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return list(manifest["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def save_checkpoint(directory: Path, round_index: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``round_<n>.pt`` atomically, record its checksum in the manifest, keep the newest ``keep``.

    The manifest is rewritten (atomically) only after the checkpoint itself is on disk, so a crash at
    any moment leaves a manifest that names only complete checkpoints.
    """
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "round": round_index, **state}, buffer)
    data = buffer.getvalue()
    path = directory / f"round_{round_index:06d}.pt"
    atomic_write_bytes(path, data)
    entries = [e for e in read_manifest(directory) if e.get("file") != path.name and (directory / e["file"]).exists()]
    entries.append({"file": path.name, "round": round_index, "bytes": len(data), "sha256": _sha256(data)})
    kept, dropped = entries[-keep:], entries[:-keep]
    manifest = {"format_version": FORMAT_VERSION, "checkpoints": kept}
    atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    names = {e["file"] for e in kept}
    for old in [directory / e["file"] for e in dropped] + [
        p for p in list_checkpoints(directory) if p.name not in names
    ]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def load_checkpoint(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """Load and check one checkpoint; with ``sha256`` the file must match the manifest's checksum."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {error.strerror}") from None
    if sha256 is not None and _sha256(data) != sha256:
        raise CheckpointError(f"checkpoint '{path}' is damaged (checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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
    """The newest usable checkpoint; a damaged one is reported and the one before it is used."""
    entries = read_manifest(directory)
    candidates = [(directory / e["file"], e.get("sha256")) for e in entries]
    listed = {path.name for path, _ in candidates}
    # Files the manifest does not know (a run from before manifests) are tried after, without a checksum.
    candidates = [(p, None) for p in list_checkpoints(directory) if p.name not in listed] + candidates
    if not candidates:
        return None
    problems = []
    for path, sha256 in reversed(candidates):
        try:
            state = load_checkpoint(path, sha256)
        except CheckpointError as error:
            problems.append(str(error))
            log.warning("%s; trying the previous checkpoint", error)
            continue
        if problems:
            log.warning("resuming from %s, the newest intact checkpoint", path.name)
        return state
    raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} older ones)" if len(problems) > 1 else ""))
