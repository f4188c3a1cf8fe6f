"""Atomic, versioned checkpoints: θ and outer state per trainer, inner state and data cursor per worker.

``store`` keeps them (atomic writes, the manifest of complete ones), ``files`` is the one-file format,
``sharded`` the folder every rank writes its part of (DCP: imported only where used, it costs a second),
``state`` checks and cuts what one holds, ``loading`` reads them back whichever their format."""

from adloco.checkpoint.files import save_checkpoint
from adloco.checkpoint.loading import latest_checkpoint, load_checkpoint
from adloco.checkpoint.state import recut_checkpoint
from adloco.checkpoint.store import (
    FORMAT_VERSION,
    MANIFEST,
    apply_umask,
    atomic_write_bytes,
    drop_checkpoints_after,
    read_manifest,
    write_failure,
)
from adloco.errors import CheckpointError
from adloco.runs import checkpoint_round, list_checkpoints

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "apply_umask",
    "atomic_write_bytes",
    "checkpoint_round",
    "drop_checkpoints_after",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "recut_checkpoint",
    "save_checkpoint",
    "write_failure",
]
