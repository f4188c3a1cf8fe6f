"""Sharded checkpoints: every rank writes the state it holds, with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the folder ``round_<n>/``: one ``__<rank>_0.distcp`` file per rank and DCP's ``.metadata``. Rank 0
contributes the shared state (trainers, exchanges in flight, counters, config) and its own workers; every other
rank only its workers, so no rank gathers the others' optimizer states. The folder is written as
``.round_<n>.tmp/`` and renamed once DCP has finished on every rank; the manifest then records a checksum per file,
so a crash at any moment leaves the previous checkpoint the newest one named.

DCP keeps tensors by name and pickles anything else, but flattens nested dicts in a way that loses empty ones and
integer keys. So each rank's state is split here into its tensors (under their path) and a skeleton holding
everything else, with each tensor replaced by a reference; the skeleton travels as a byte tensor and is read back
with ``weights_only`` loading. A rank reads the shared state and the workers it asks for, whatever the rank
count that wrote them.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from adloco.algorithms.sharding import UNSHARDED, ShardLayout
from adloco.checkpoint.schema import TRAIN, readable_version, stamped, upgraded
from adloco.checkpoint.state import recut_checkpoint
from adloco.checkpoint.store import read_manifest, record_checkpoint, sha256_of, write_failure
from adloco.errors import CheckpointError, StorageError

_REF = "\x00tensor:"  # marks a tensor's place in a skeleton; no state string starts with a NUL
_SKELETON = "skeleton/"


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with each tensor moved into ``tensors`` under its path and replaced by a reference."""
    if torch.is_tensor(value):
        tensors[path] = value.detach().cpu().contiguous()
        return _REF + path
    if isinstance(value, dict):
        return {k: _split(v, f"{path}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value))
    return value


def _join(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, str) and value.startswith(_REF):
        return tensors[value[len(_REF) :]]
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_join(v, tensors) for v in value)
    return value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever it runs without a process group, as adloco means it to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _as_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def save_sharded_checkpoint(
    directory: Path,
    round_number: int,
    part: dict[str, Any],
    keep: int,
    rank: int,
    barrier: Callable[[], None],
    distributed: bool,
) -> Path:
    """Write this rank's ``part`` of checkpoint ``round_<n>/`` (collective: every rank calls it); rank 0's part
    holds the shared state, to which the format version, kind (an adloco train run's: the one writer of this
    format) and round are added as ``save_checkpoint`` adds them to a file. Rank 0 then renames the folder into
    place and records it in the manifest."""
    final = directory / f"round_{round_number:06d}"
    tmp = directory / f".{final.name}.tmp"
    if rank == 0:
        for stale in directory.glob(".round_*.tmp"):  # saves that died half-way; never mixed into this one
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as error:
            raise write_failure(error, "checkpoint", tmp) from None
    barrier()
    if rank == 0:
        part = stamped({"round": round_number, **part}, TRAIN)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(part, f"{rank}", tensors)
    state = {**tensors, f"{_SKELETON}{rank}": _as_bytes(skeleton)}
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not distributed)
    except OSError as error:
        raise write_failure(error, "checkpoint", tmp) from None
    except CheckpointException as error:  # DCP's wrapper of every rank's failure (a BaseException)
        raise _save_failure(error, tmp) from None
    if rank == 0:
        _finish(directory, tmp, final, round_number, keep)
    return final


def _save_failure(error: CheckpointException, tmp: Path) -> StorageError:
    """One line for a failed DCP save: the first rank's own error, as a write failure where it is one."""
    first = next(iter(error.failures.values()), None)
    if isinstance(first, tuple):  # (exception, its traceback), as DCP records each rank's failure
        first = first[0]
    if isinstance(first, OSError):
        return write_failure(first, "checkpoint", tmp)
    return StorageError(f"writing checkpoint '{tmp}' failed ({type(first).__name__}: {str(first)[:120]})")


def _finish(directory: Path, tmp: Path, final: Path, round_index: int, keep: int) -> None:
    """Checksums, the rename that makes the folder a checkpoint, and its manifest entry (rank 0)."""
    try:
        files = {p.name: sha256_of(p.read_bytes()) for p in sorted(tmp.iterdir())}
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if final.exists():  # the same round saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
    except OSError as error:
        raise write_failure(error, "checkpoint", final) from None
    record_checkpoint(directory, {"file": final.name, "round": round_index, "bytes": size, "files": files}, keep)


def load_sharded_checkpoint(
    path: Path, wanted: Callable[[int], bool] | None = None, layout: ShardLayout = UNSHARDED
) -> dict[str, Any]:
    """The parts of ``round_<n>/`` that a rank holding shard ``layout.index`` of its workers needs, checked against
    the manifest's checksums and put back together: the run's counters and config, that shard's shared state and
    the workers ``wanted`` accepts (all without it); no other tensor is read. A checkpoint of another shard count is
    read whole (for those workers) and cut anew. The state comes brought up to this format version."""
    _check_files(path)
    try:
        reader = dcp.FileSystemReader(str(path))
        keys = reader.read_metadata().state_dict_metadata
        skeletons = _read(path, {k: keys[k] for k in keys if k.startswith(_SKELETON)})
        parts = {
            int(key[len(_SKELETON) :]): torch.load(io.BytesIO(value.numpy().tobytes()), weights_only=True)
            for key, value in skeletons.items()
        }
    except (Exception, CheckpointException) as error:  # DCP and torch raise many types for damaged files
        raise _damaged(path, error) from None
    head = _head(path, parts)
    saved = _written_shards(head)
    columns = [layout.index] if saved == layout.count else list(range(saved))
    ranks = {rank for rank, part in parts.items() if _shard_of(part) in columns}
    try:
        tensors = _read(
            path,
            {
                key: item
                for key, item in keys.items()
                if not key.startswith(_SKELETON)
                and int(key.split("/")[0]) in ranks
                and (_worker_of(key) is None or wanted is None or wanted(_worker_of(key)))
            },
        )
    except (Exception, CheckpointException) as error:
        raise _damaged(path, error) from None
    joined = {rank: _join(_without_unwanted(parts[rank], wanted), tensors) for rank in ranks}
    states = [
        upgraded(
            _merged(path, head, {r: p for r, p in joined.items() if _shard_of(parts[r]) == c}, c),
            f"checkpoint '{path}'",
        )
        for c in columns
    ]
    if saved == layout.count:
        return states[0]
    return recut_checkpoint(states, layout, path)


def _damaged(path: Path, error: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}' is damaged or not a checkpoint ({type(error).__name__})")


def _head(path: Path, parts: dict[int, Any]) -> dict[str, Any]:
    """Rank 0's part: the format version, round, counters and config (the shard count it was written with); one of
    a newer version is refused before any tensor is read."""
    head = next((p for p in parts.values() if isinstance(p, dict) and "format_version" in p), None)
    if head is None:
        raise CheckpointError(f"checkpoint '{path}' has no shared state (rank 0's part)")
    readable_version(head, f"checkpoint '{path}'")
    return head


def _written_shards(head: dict[str, Any]) -> int:
    """The shards per worker a checkpoint was written with, read from rank 0's part before the parts are put
    together (and the state migrated): in version 1 the part held no config before configs were kept, or a config
    without ``shards`` before workers could be sharded; such a checkpoint was written with one."""
    config = head.get("config")
    return int(config.get("shards", 1)) if isinstance(config, dict) else 1


def _read(path: Path, items: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``items`` (DCP metadata by key) from the checkpoint folder ``path``."""
    template = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in items.items()}
    with _single_process_quiet():
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return template


def _shard_of(part: Any) -> int:
    """The shard of its workers that the rank which wrote ``part`` held (0 for unsharded workers; a version-1 part
    from before workers could be sharded holds none)."""
    return int(part.get("cluster", {}).get("shard", 0)) if isinstance(part, dict) else 0


def _merged(path: Path, head: dict[str, Any], joined: dict[int, Any], shard: int) -> dict[str, Any]:
    """One state from the run's head (format version, round, counters, config), the shard's shared state and its
    workers."""
    lead = next((p for p in joined.values() if "trainers" in p.get("cluster", {})), None)
    if lead is None:
        raise CheckpointError(f"checkpoint '{path}' holds no shard {shard} of the workers' models")
    cluster = {k: v for k, v in lead["cluster"].items() if k != "shard"}
    for part in joined.values():
        if part is not lead:
            cluster["workers"].update(part["cluster"]["workers"])
    return {**{k: v for k, v in head.items() if k != "cluster"}, "cluster": cluster}


def _worker_of(key: str) -> int | None:
    """The worker whose state a tensor key (``<rank>/cluster/workers/<w>/...``) belongs to; None for shared state."""
    parts = key.split("/")
    return int(parts[3]) if len(parts) > 3 and parts[1:3] == ["cluster", "workers"] else None


def _without_unwanted(part: Any, wanted: Callable[[int], bool] | None) -> Any:
    if wanted is None or not isinstance(part, dict) or "cluster" not in part:
        return part
    workers = {w: state for w, state in part["cluster"].get("workers", {}).items() if wanted(w)}
    return {**part, "cluster": {**part["cluster"], "workers": workers}}


def _check_files(path: Path) -> None:
    entry = next((e for e in read_manifest(path.parent) if e["file"] == path.name), None)
    files = entry.get("files") if entry is not None else None
    if not isinstance(files, dict):
        return  # not (yet) in the manifest: the folder is whole, as only a finished save is renamed into place
    # Every rank checks every file, so all ranks take the same checkpoint (or fall back to the same older one).
    for name, digest in files.items():
        try:
            if sha256_of((path / name).read_bytes()) == digest:
                continue
        except FileNotFoundError:
            pass  # missing: damaged, as below
        except OSError as error:
            raise CheckpointError(f"checkpoint '{path}' cannot be read: {error.strerror}") from None
        raise CheckpointError(f"checkpoint '{path}' is damaged (file {name} is missing or fails its checksum)")
