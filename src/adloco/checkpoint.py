"""Atomic, versioned checkpoints: θ and outer state per trainer, inner state and data cursor per worker."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adloco.algorithms.sharding import UNSHARDED, ShardLayout, recut
from adloco.errors import CheckpointError, StorageError
from adloco.runs import CHECKPOINT_NAME, list_checkpoints
from adloco.runs import checkpoint_round as checkpoint_round  # where callers have always found it

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


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


MANIFEST = "manifest.json"


def _sha256(data: bytes) -> str:
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


def save_checkpoint(directory: Path, round_number: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``round_<n>.pt`` (the state after round n, counted from 1) atomically, record its checksum in the
    manifest, keep the newest ``keep``.

    The manifest is rewritten (atomically) only after the checkpoint itself is on disk, so a crash at
    any moment leaves a manifest that names only complete checkpoints.
    """
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "round": round_number, **state}, buffer)
    data = buffer.getvalue()
    path = directory / f"round_{round_number:06d}.pt"
    try:
        atomic_write_bytes(path, data)
    except OSError as error:
        raise write_failure(error, "checkpoint", path) from None
    _record(directory, {"file": path.name, "round": round_number, "bytes": len(data), "sha256": _sha256(data)}, keep)
    return path


def _record(directory: Path, entry: dict[str, Any], keep: int) -> None:
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
            _remove(old)
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
            _remove(directory / entry["file"])
        except OSError as error:  # no longer named: an old checkpoint left behind costs only space
            log.warning("could not remove checkpoint %s: %s", entry["file"], error.strerror)


def _remove(path: Path) -> None:
    """A checkpoint file or sharded folder, gone."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def load_checkpoint(
    path: Path,
    sha256: str | None = None,
    training: bool = False,
    wanted: Callable[[int], bool] | None = None,
    layout: ShardLayout = UNSHARDED,
) -> dict[str, Any]:
    """Load and check one checkpoint; with ``sha256`` the file must match the manifest's checksum.

    With ``training`` the top level must also have the shape a training run writes (trainers, workers,
    counters), so a foreign torch file is refused here rather than failing half-way through a resume. With
    ``wanted`` the workers it refuses are left out (a sharded checkpoint does not even read them); ``layout``: the
    shard of sharded workers whose state a rank reads (cut anew from a checkpoint of another shard count).
    """
    if path.is_dir():
        from adloco.checkpoint_sharded import load_sharded_checkpoint  # it builds on this module

        return _checked_shape(path, load_sharded_checkpoint(path, wanted, layout), training)
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
            f"checkpoint '{path}' has format version {state['format_version']!r}, this adloco reads {FORMAT_VERSION}"
        )
    state = _checked_shape(path, state, training)
    if wanted is not None and isinstance(state.get("cluster"), dict):
        cluster = state["cluster"]
        workers = cluster.get("workers", {})
        # checkpoints from before the shared b_max table kept each worker's b_max with the worker only
        cluster.setdefault("b_max", {w: s["b_max"] for w, s in workers.items() if "b_max" in s})
        cluster["workers"] = {w: s for w, s in workers.items() if wanted(w)}
    return state if layout.count == 1 else recut_checkpoint([state], layout, path)


def recut_checkpoint(columns: list[dict[str, Any]], layout: ShardLayout, path: Path) -> dict[str, Any]:
    """A checkpoint written by ``len(columns)`` shards (one state each), cut for shard ``layout.index`` of
    ``layout.count``."""
    if layout.shapes is None:
        raise CheckpointError(
            f"checkpoint '{path}' was written by {len(columns)} shards per worker, not {layout.count}"
        )
    log.info("checkpoint %s: %d shards per worker, cut anew for %d", path.name, len(columns), layout.count)
    state = recut(columns, layout.index, layout.count, layout.shapes())
    workers = state.get("cluster", {}).get("workers", {})
    # A codec's error feedback is kept per fragment as one flat residual, whose rows are no parameter's
    if any(isinstance(w, dict) and w.get("error_feedback") for w in workers.values()):
        log.warning("error-feedback residuals restart from zero after a change of shard count")
        for worker in workers.values():
            worker["error_feedback"] = None
    return state


def _checked_shape(path: Path, state: dict[str, Any], training: bool) -> dict[str, Any]:
    problem = _shape_problem(state) if training else ""
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is not an adloco training checkpoint ({problem})")
    return state


_COUNTERS = ("round", "tokens", "step", "bytes")


def _shape_problem(state: dict[str, Any]) -> str:
    """What is missing from a loaded checkpoint's top level ('' when it has the shape training writes)."""
    if not isinstance(state.get("round"), int):
        return "no round number"
    cluster, counters = state.get("cluster"), state.get("counters")
    if not isinstance(cluster, dict) or not isinstance(cluster.get("trainers"), dict) or not cluster["trainers"]:
        return "no trainer state"
    if not isinstance(cluster.get("workers"), dict):
        return "no worker state"
    if not isinstance(counters, dict) or not all(isinstance(counters.get(key), int) for key in _COUNTERS):
        return "no progress counters"
    return ""


def latest_checkpoint(
    directory: Path,
    training: bool = False,
    wanted: Callable[[int], bool] | None = None,
    layout: ShardLayout = UNSHARDED,
    on_fallback: Callable[[list[str], Path], None] | None = None,
) -> dict[str, Any] | None:
    """The newest usable checkpoint (with only the workers ``wanted`` accepts); a damaged one is reported (to
    ``on_fallback`` with the problems and the checkpoint used instead, else to the log) and the one before it is
    used."""
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
            state = load_checkpoint(path, sha256, training, wanted, layout)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        # Reported only when a checkpoint is used: when none is, the error below says it all in one line.
        if problems and on_fallback is not None:
            on_fallback(problems, path)
        elif problems:
            for problem in problems:
                log.warning("%s; using an older checkpoint", problem)
            log.warning("using %s, the newest intact checkpoint", path.name)
        return state
    raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} older ones)" if len(problems) > 1 else ""))
