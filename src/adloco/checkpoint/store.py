"""Where checkpoints live: files written atomically, the manifest of complete checkpoints with their checksums
(kept to the newest few), and one-line errors for a write that fails. Both formats, a file and a sharded folder,
are stored through it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from adloco.checkpoint.names import CHECKPOINT_NAME, list_checkpoints
from adloco.checkpoint.schema import FORMAT_VERSION
from adloco.errors import StorageError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def write_failure(error: OSError, what: str, path: Path | str) -> StorageError:
    """``error`` at a write of ``what`` as one line naming the write, e.g. "no space left on device while ..."."""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else str(error)) or type(error).__name__
    reason = reason[:1].lower() + reason[1:]
    failure = StorageError(f"{reason} while writing {what} '{path}'")
    failure.disk_full = error.errno == errno.ENOSPC
    return failure


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the new content, never a torn file.

    On a failed write (full disk, read-only file system) the OSError propagates, the old content stays and
    the partial temporary file is removed so that it does not keep holding the space.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never hide the write's own error
            tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def apply_umask(root: Path) -> None:
    """Give ``root`` and everything under it the modes the user's umask gives new files and folders."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(directory: Path) -> list[dict[str, Any]]:
    """Checkpoint entries (file, round, bytes, sha256), oldest first; empty if there is no readable manifest."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        entries = list(manifest["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    # A hand-edited or damaged manifest may hold anything; entries that name no checkpoint file are ignored.
    return [
        e
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("file"), str) and CHECKPOINT_NAME.match(e["file"])
    ]


def record_checkpoint(directory: Path, entry: dict[str, Any], keep: int) -> None:
    """Add a checkpoint that is complete on disk to the manifest, and remove all but the newest ``keep``."""
    path = directory / entry["file"]
    entries = [e for e in read_manifest(directory) if e.get("file") != path.name and (directory / e["file"]).exists()]
    entries.append(entry)
    kept, dropped = entries[-keep:], entries[:-keep]
    manifest = {"format_version": FORMAT_VERSION, "checkpoints": kept}
    try:
        atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as error:  # the previous manifest stays: it names only checkpoints that are complete
        raise write_failure(error, "checkpoint manifest", directory / MANIFEST) from None
    names = {e["file"] for e in kept}
    for old in [directory / e["file"] for e in dropped] + [
        p for p in list_checkpoints(directory) if p.name not in names
    ]:
        try:
            remove_checkpoint(old)
        except OSError as error:  # the new checkpoint is safe; an old one left behind costs only space
            log.warning("could not remove old checkpoint %s: %s", old.name, error.strerror)


def drop_checkpoints_after(directory: Path, round_number: int) -> None:
    """Forget the checkpoints of rounds after ``round_number`` (the manifest first, atomically, then the files):
    a run going on from that round trains them again."""
    entries = read_manifest(directory)
    kept = [e for e in entries if e.get("round", 0) <= round_number]
    if len(kept) == len(entries):
        return
    manifest = {"format_version": FORMAT_VERSION, "checkpoints": kept}
    try:
        atomic_write_bytes(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as error:
        raise write_failure(error, "checkpoint manifest", directory / MANIFEST) from None
    for entry in (e for e in entries if e not in kept):
        try:
            remove_checkpoint(directory / entry["file"])
        except OSError as error:  # no longer named: an old checkpoint left behind costs only space
            log.warning("could not remove checkpoint %s: %s", entry["file"], error.strerror)


def remove_checkpoint(path: Path) -> None:
    """A checkpoint file or sharded folder, gone."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
