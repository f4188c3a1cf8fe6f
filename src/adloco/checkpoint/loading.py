"""Reading a run's checkpoints back: one by its path, whichever its format, or the newest intact one of a folder."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adloco.algorithms.sharding import UNSHARDED, ShardLayout
from adloco.checkpoint.files import load_file
from adloco.checkpoint.names import list_checkpoints
from adloco.checkpoint.state import checked_shape, only_wanted, recut_checkpoint
from adloco.checkpoint.store import read_manifest
from adloco.errors import CheckpointError

log = logging.getLogger(__name__)


def load_checkpoint(
    path: Path,
    sha256: str | None = None,
    kind: str | None = None,
    wanted: Callable[[int], bool] | None = None,
    layout: ShardLayout = UNSHARDED,
) -> dict[str, Any]:
    """Load and check one checkpoint, brought up to this format version; with ``sha256`` the file must match the
    manifest's checksum.

    With ``kind`` (``schema.TRAIN`` or ``REPLICA``) it must be of that kind and have the shape its driver writes
    (a train run's: trainers, workers, counters), so a foreign torch file is refused here rather than failing
    half-way through a resume. With ``wanted`` the workers it refuses are left out (a sharded checkpoint does not
    even read them); ``layout``: the shard of sharded workers whose state a rank reads (cut anew from a checkpoint
    of another shard count).
    """
    if path.is_dir():
        from adloco.checkpoint.sharded import load_sharded_checkpoint  # DCP's import costs a second: only here

        return checked_shape(path, load_sharded_checkpoint(path, wanted, layout), kind)
    state = only_wanted(checked_shape(path, load_file(path, sha256), kind), wanted)
    return state if layout.count == 1 else recut_checkpoint([state], layout, path)


def latest_checkpoint(
    directory: Path,
    kind: str | None = None,
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
            state = load_checkpoint(path, sha256, kind, wanted, layout)
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
