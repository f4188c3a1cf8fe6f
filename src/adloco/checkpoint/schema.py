"""The one checkpoint format: the version and kind every saved state carries, and the migration table that
brings a state of an older version up to this one as it is read.

Three drivers save state, each a kind: ``train`` (an ``adloco train`` run's checkpoint: the cluster's state, the
counters and the config), ``loop`` (``adloco.DiLoCo.state_dict()``'s payload: a user's loop, the HF Trainer,
Lightning) and ``replica`` (a replica of ``adloco train``: a loop's state, the model's and the inner optimizer's).
Version 1 wrote ``format_version`` into checkpoint files only (a loop's state carried none) and no kind; each of its
readers filled what older states lacked as it went. Now every reader gets a state through ``upgraded``: a newer
version is refused, an older one goes through the steps of ``MIGRATIONS`` in turn, so readers see one shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from adloco.errors import CheckpointError

FORMAT_VERSION = 2
TRAIN, LOOP, REPLICA = "train", "loop", "replica"
KINDS = {
    TRAIN: "an adloco train run's checkpoint",
    LOOP: "a loop's DiLoCo state",
    REPLICA: "the checkpoint of a replica of adloco train",
}

# A step from version v to v + 1, in place: (state, what the reader knows) -> the state. What the reader knows
# fills what the state itself cannot say (a loop's state: its settings, H and worker, see ``_loop_1``).
Migration = Callable[[dict[str, Any], Mapping[str, Any]], dict[str, Any]]


def stamped(state: dict[str, Any], kind: str) -> dict[str, Any]:
    """``state`` as written: with this format's version and its ``kind``."""
    assert kind in KINDS, kind
    return {**state, "format_version": FORMAT_VERSION, "kind": kind}


def upgraded(state: Any, where: str, known: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``state`` (read from ``where``, as a message names it) in this format, brought up from its own version (in
    place); CheckpointError for a state of a newer version, of an unknown kind or no adloco state at all."""
    version = readable_version(state, where)
    while version < FORMAT_VERSION:
        state = MIGRATIONS[version](state, known or {})
        version += 1
    if state.get("kind") not in KINDS:
        raise CheckpointError(f"{where} is of a kind this adloco does not know ({state.get('kind')!r})")
    return state


def check_kind(state: dict[str, Any], kind: str, where: str) -> None:
    """CheckpointError unless ``state`` (upgraded) is of ``kind``."""
    if state["kind"] != kind:
        raise CheckpointError(f"{where} is {KINDS[state['kind']]}, not {KINDS[kind]}")


def readable_version(state: Any, where: str) -> int:
    """The format version ``state`` was written in; CheckpointError for one newer than this adloco's."""
    version = format_version(state, where)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format version {version}, newer than this adloco's {FORMAT_VERSION}: load it with the "
            "adloco that wrote it, or a newer one"
        )
    return version


def format_version(state: Any, where: str) -> int:
    """The format version ``state`` was written in."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is not an adloco checkpoint")
    if "format_version" not in state:
        if "inner_step" in state:  # a loop's state, which carried no version in version 1
            return 1
        raise CheckpointError(f"{where} is not an adloco checkpoint")
    version = state["format_version"]
    if type(version) is not int or version < 1:  # a bool is no version either
        raise CheckpointError(f"{where} has format version {version!r}, which no adloco writes")
    return version


# -- version 1 -> 2 ------------------------------------------------------------------------------------------------
# Each default is what version 1's readers assumed where a state lacked the key: the states of older adloco
# (configs, fp16, error feedback, ... came in turn) resume as they did. A value of the wrong type is left as it
# is, for the shape checks and the loaders to refuse.


def upgrade_1_to_2(state: dict[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    """Version 1 to 2: the kind, told by the keys only each kind has, and the defaults each kind's state lacked."""
    kind = REPLICA if "diloco" in state else LOOP if "inner_step" in state else TRAIN
    if kind == TRAIN:
        _train_1(state)
    elif kind == LOOP:
        _loop_1(state, known)
    # a replica's DiLoCo state is a loop's, brought up when DiLoCo loads it; its model and optimizer are torch's
    state["format_version"], state["kind"] = 2, kind
    return state


MIGRATIONS: dict[int, Migration] = {1: upgrade_1_to_2}


def _train_1(state: dict[str, Any]) -> None:
    state.setdefault("config", None)  # written before configs were kept: no settings to compare a resume's with
    cluster = state.get("cluster")
    if not isinstance(cluster, dict):
        return
    workers = _dicts(cluster.get("workers"))
    if not cluster.get("b_max"):  # before the shared table every worker kept its b_max with its own state only
        cluster["b_max"] = {w: s["b_max"] for w, s in workers.items() if "b_max" in s}
    cluster.setdefault("pending", {})
    cluster.setdefault("costs", None)  # before the cost model: this start's own measurement stands
    cluster.setdefault("sync_every", None)  # written only for sync_every=auto
    cluster.setdefault("retired_streams", {})  # written only once an elastic resume retired workers
    for worker in workers.values():
        worker.setdefault("params", None)  # θ's, as for every method but streaming
        worker.setdefault("loss_scale", {"scale": 1.0, "good_steps": 0})  # before fp16: the constant scale 1
        _sync_worker_1(worker)
    _shared_1(cluster)


def _loop_1(state: dict[str, Any], known: Mapping[str, Any]) -> None:
    """A loop's state; ``known`` (the loading DiLoCo's): its ``settings``, ``sync_every`` (its first H) and
    ``worker_id``."""
    settings = state.get("settings")
    if settings is None:  # before settings were saved: any DiLoCo's state was taken as its own
        state["settings"] = dict(known["settings"])
    elif isinstance(settings, dict):
        settings.setdefault("outer_optimizer", "sgd")  # before the outer optimizer could be chosen
    if "rounds" not in state:  # before H could change: every round was H steps long
        state["rounds"] = int(state["inner_step"]) // int(known["sync_every"])
    state.setdefault("sync_every", None)
    state.setdefault("peak_lr", 0.0)  # before auto's lr ratio: no lr seen yet
    state.setdefault("replica", None)  # before a replica's state held its torchft step
    batch = state.get("batch")
    if isinstance(batch, dict) and "samples_by_worker" not in batch:
        # before every worker's count was kept: this worker's alone (and before that, none)
        batch["samples_by_worker"] = {int(known["worker_id"]): int(batch.pop("worker_samples", 0))}
    if isinstance(state.get("worker"), dict):  # None: a peer's state that a replica heals from
        _sync_worker_1(state["worker"])
    _shared_1(state)


def _sync_worker_1(worker: dict[str, Any]) -> None:
    """A worker's outer state, which the sync strategy keeps."""
    worker.setdefault("error_feedback", None)  # before codecs kept residuals
    worker.setdefault("eager", None)  # before outer.overlap=eager's own copy


def _shared_1(state: dict[str, Any]) -> None:
    """What a train run's cluster and a loop keep alike: trainers, exchanges in flight, the rule choosing H."""
    for trainer in _dicts(state.get("trainers")).values():
        trainer.setdefault("timed", None)  # written only by the time-aware controller (none before it)
    for item in _dicts(state.get("pending")).values():
        drift = item.get("drift") or {}  # before the drift and the drop were kept: none, and applied
        if isinstance(drift, dict):
            item["drift"] = {"worker_sq": drift.get("worker_sq", {}), "mean_sq": drift.get("mean_sq", 0.0)}
        item.setdefault("dropped", False)
    rule = state.get("sync_every")
    if isinstance(rule, dict) and "settled" not in rule:
        # before ``settled`` was kept: costs measured meant the rule had decided on them
        try:
            seconds = float(rule["step_seconds"]), float(rule["exchange_seconds"])
        except (KeyError, TypeError, ValueError):
            return  # no rule's state: its loader refuses it
        rule["settled"] = all(math.isfinite(s) for s in seconds)


def _dicts(value: Any) -> dict[Any, dict[str, Any]]:
    """The entries of ``value`` (a dict of states) that are states; nothing for anything else."""
    return {k: v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else {}
