"""What a checkpoint holds, checked and cut: its kind and the shape that kind has, the workers a rank asks for, and
a sharded worker's state cut anew for another shard count."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adloco.algorithms.sharding import ShardLayout, recut
from adloco.checkpoint.schema import REPLICA, TRAIN, check_kind
from adloco.errors import CheckpointError

log = logging.getLogger(__name__)


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


def checked_shape(path: Path, state: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """``state`` (upgraded), once it is of ``kind`` (None: any) and has the shape that kind's driver writes, so a
    foreign file is refused here rather than half-way through a resume."""
    if kind is None:
        return state
    check_kind(state, kind, f"checkpoint '{path}'")
    if kind == TRAIN and shape_problem(state):
        raise CheckpointError(f"checkpoint '{path}' is not an adloco training checkpoint ({shape_problem(state)})")
    if kind == REPLICA and not {"diloco", "model", "optimizer"} <= set(state):
        raise CheckpointError(f"checkpoint '{path}' is not a replica's: it lacks its model or DiLoCo state")
    return state


_COUNTERS = ("round", "tokens", "step", "bytes")


def shape_problem(state: dict[str, Any]) -> str:
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


def only_wanted(state: dict[str, Any], wanted: Callable[[int], bool] | None) -> dict[str, Any]:
    """``state`` with only the workers ``wanted`` accepts."""
    if wanted is not None and isinstance(state.get("cluster"), dict):
        cluster = state["cluster"]
        cluster["workers"] = {w: s for w, s in cluster.get("workers", {}).items() if wanted(w)}
    return state
