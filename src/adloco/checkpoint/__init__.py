"""Atomic, versioned checkpoints: θ and outer state per trainer, inner state and data cursor per worker.

``schema`` is their one format (the version and kind every saved state carries, the migrations from older
versions), ``store`` keeps them (atomic writes, the manifest of complete ones), ``files`` is the one-file format,
``sharded`` the folder every rank writes its part of (DCP: imported only where used, it costs a second),
``state`` checks and cuts what one holds, ``loading`` reads them back whichever their format, ``names`` finds them
by name. The package's names load on first use, so ``names`` serves checks made before torch is imported."""

from __future__ import annotations

import importlib
from typing import Any

_OWNERS = {
    "CheckpointError": "adloco.errors",
    "FORMAT_VERSION": "adloco.checkpoint.schema",
    "KINDS": "adloco.checkpoint.schema",
    "LOOP": "adloco.checkpoint.schema",
    "MIGRATIONS": "adloco.checkpoint.schema",
    "REPLICA": "adloco.checkpoint.schema",
    "TRAIN": "adloco.checkpoint.schema",
    "MANIFEST": "adloco.checkpoint.store",
    "apply_umask": "adloco.checkpoint.store",
    "atomic_write_bytes": "adloco.checkpoint.store",
    "check_resumable": "adloco.checkpoint.names",
    "checkpoint_round": "adloco.checkpoint.names",
    "drop_checkpoints_after": "adloco.checkpoint.store",
    "latest_checkpoint": "adloco.checkpoint.loading",
    "list_checkpoints": "adloco.checkpoint.names",
    "load_checkpoint": "adloco.checkpoint.loading",
    "read_manifest": "adloco.checkpoint.store",
    "recut_checkpoint": "adloco.checkpoint.state",
    "save_checkpoint": "adloco.checkpoint.files",
    "upgraded": "adloco.checkpoint.schema",
    "write_failure": "adloco.checkpoint.store",
}
__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "KINDS",
    "LOOP",
    "MANIFEST",
    "MIGRATIONS",
    "REPLICA",
    "TRAIN",
    "apply_umask",
    "atomic_write_bytes",
    "check_resumable",
    "checkpoint_round",
    "drop_checkpoints_after",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "recut_checkpoint",
    "save_checkpoint",
    "upgraded",
    "write_failure",
]


def __getattr__(name: str) -> Any:
    if name not in _OWNERS:
        raise AttributeError(f"module 'adloco.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(_OWNERS[name]), name)
