"""What a user's DiLoCo saves and loads: its state for checkpoints (one value per rank) and for a joining
replica's heal (a peer's, without that peer's own error feedback)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from adloco.algorithms.sharding import local_rows
from adloco.checkpoint.schema import LOOP, check_kind, stamped, upgraded
from adloco.workers.reports import WorkerRound

if TYPE_CHECKING:
    from adloco.api.replica import Replica
    from adloco.api.settings import LoopSettings
    from adloco.api.worker import WorkerShards

_STATE_KEY = "adloco_diloco"


def onto_device_of_model(device: torch.device) -> Callable[[Any, str], Any]:
    """``torch.load``'s placement of a saved state: what a GPU saved lands on this model's GPU (whatever GPU
    index the saver had) or, for a model on the CPU, in host memory; what was in host memory stays there."""

    def place(storage: Any, location: str) -> Any:
        if location.startswith("cuda") and device.type == "cuda":
            return storage.cuda(device.index if device.index is not None else torch.cuda.current_device())
        return storage  # deserialized in host memory

    return place


class LoopState:
    """The state half of ``adloco.DiLoCo`` (θ, outer state, exchanges in flight, counters, the adaptive batch)."""

    # the loop's own attributes, set by DiLoCo
    settings: LoopSettings
    shards: WorkerShards | None
    global_rank: int
    rank: int
    world_size: int
    params: list[torch.Tensor]
    replica: Replica | None

    def state_dict(self) -> dict[str, Any]:
        """θ, the outer optimizer state, exchanges in flight, this rank's error feedback (and eager copy) and the
        round in progress, as one value per rank (a DCP ``Stateful`` keeps each rank's apart)."""
        return {self._state_key: self._payload(own_worker=True)}

    def _payload(self, own_worker: bool) -> bytes:
        """The state in adloco's checkpoint format (``adloco.checkpoint.schema``: a loop's kind), as bytes."""
        state = {
            "inner_step": self.inner_step,
            "world_size": self.world_size,
            "settings": _settings(self.settings, self.shards, self._batch is not None),
            "trainers": {k: trainer.state_dict() for k, trainer in self.trainers.items()},
            "pending": self.sync.state_dict(),
            "worker": self.sync.worker_state(self.rank) if own_worker else None,
            "round": self._state.local[self.rank].to_tensor(),
            "batch": None if self._batch is None else self._batch.state_dict(),
            "replica": self._replica_state() if own_worker else None,
            **self.rounds.state_dict(),
        }
        buffer = io.BytesIO()
        torch.save(stamped(state, LOOP), buffer)
        return buffer.getvalue()

    def _replica_state(self) -> dict[str, int] | None:
        """A fault-tolerant replica's torchft step (its count of commits), which its checkpoint carries: replicas
        started again from checkpoints heal from the one furthest on, and not at all when all are alike."""
        return None if self.replica is None else dict(self.replica.manager.state_dict())

    def _shared_state(self) -> bytes:
        """What a joining replica heals from: this state without this worker's own error feedback."""
        return self._payload(own_worker=False)

    def _heal(self, payload: bytes) -> None:
        """A peer's state, taken at the round's start: the model restarts from its θ with a fresh inner optimizer."""
        self._load_payload(payload)
        self.workers[self.rank].load_params(self.trainer.theta)
        self.sync.join_worker(self.rank)  # an eager copy starts from θ too
        self.optimizer.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._state_key
        if key not in state_dict:
            raise ValueError(
                f"this state holds no DiLoCo state of rank {self.global_rank} (keys: {sorted(state_dict)[:4]})"
            )
        self._load_payload(state_dict[key], check_order=True)

    def _load_payload(self, payload: bytes, check_order: bool = False) -> None:
        device = local_rows(self.params[0]).device
        untouched = check_order and self._holds_construction_theta()  # before θ is replaced below, on every rank
        settings = _settings(self.settings, self.shards, self._batch is not None)
        where = f"the DiLoCo state of rank {self.global_rank}"
        loaded = torch.load(io.BytesIO(payload), weights_only=True, map_location=onto_device_of_model(device))
        # an older format version is brought up with what only this DiLoCo knows (its settings, H and worker)
        state = upgraded(loaded, where, {"settings": settings, "sync_every": self.rounds.fixed, "worker_id": self.rank})
        check_kind(state, LOOP, where)
        if state["world_size"] != self.world_size:
            raise ValueError(f"the state was saved by {state['world_size']} ranks; this job has {self.world_size}")
        if untouched and WorkerRound.from_tensor(state["round"]).steps:
            raise ValueError(
                "this DiLoCo state was saved mid-round and the model still holds rank 0's parameters, which "
                "DiLoCo(...) gave every rank: load each rank's own model state after DiLoCo(...) is built and before "
                "diloco.load_state_dict (in dcp.load, the model before the DiLoCo object)"
            )
        if state["settings"] != settings:
            raise ValueError(f"the state was saved with other settings ({state['settings']}); now {settings}")
        saved = {int(k): trainer for k, trainer in state["trainers"].items()}
        if any(k not in self.trainers for k in saved):
            raise ValueError("this DiLoCo's trainers merged after the state was saved: load it into a new DiLoCo")
        for merged in [k for k in self.trainers if k not in saved]:
            del self.trainers[merged]  # merged into another before the state was saved
        for k, trainer in saved.items():
            self.trainers[k].load_state_dict(trainer)
            self.comm.register_group(self.trainers[k].worker_ids)
        self.sync.load_state_dict(state["pending"])
        drifted = [p.clone() for p in self.workers[self.rank].params]  # the model's own state is the user's to load
        if state["worker"] is not None:  # None: a peer's state a replica healed from (its feedback is its own)
            self.sync.load_worker_state(self.rank, state["worker"])
        self.workers[self.rank].load_params(drifted)
        self.inner_step = int(state["inner_step"])
        in_progress = WorkerRound.from_tensor(state["round"])
        self.rounds.load_state_dict(state)
        self._state = self._new_round()
        self._state.first_step = self.inner_step - len(in_progress.steps)
        self._state.local[self.rank] = in_progress
        if self._batch is not None:
            self._batch.load_state_dict(state["batch"])  # the round's plan and β2 follow the batch it holds
            self._batch.first_step = self.round_step == 0
            self._batch.round_steps = self.round_step
        if state["replica"] is not None and self.replica is not None:
            self.replica.manager.load_state_dict(state["replica"])

    def _holds_construction_theta(self) -> bool:
        """Whether every rank's model of a DiLoCo that has not trained yet still holds the θ its construction gave
        them all (rank 0's parameters): then each rank's own model state, if it was loaded, was loaded before
        ``DiLoCo(...)`` and overwritten. Every rank must hold it: rank 0's own state is θ when a framework restored
        rank 0's model everywhere first. One small collective, once at a resume; one rank alone keeps its own."""
        if self.replica is not None or self.world_size == 1 or self.inner_step or self.rounds.count:
            return False
        pairs = zip(self.workers[self.rank].params, self.trainer.theta, strict=True)
        mine = float(all(torch.equal(p, t.to(p.device)) for p, t in pairs))
        return min(v[0] for v in self.comm.gather_worker_scalars({self.rank: [mine]}).values()) > 0

    @property
    def _state_key(self) -> str:
        """This rank's own key: a DCP checkpoint keeps each rank's state apart (each shard of a worker too)."""
        return f"{_STATE_KEY}_rank{self.global_rank}"


def _settings(loop: LoopSettings, shards: WorkerShards | None, adaptive: bool) -> dict[str, Any]:
    """What a saved state only fits: the method, H, the exchange's shape, the trainers and the batch."""
    return {
        "method": loop.method,
        "sync_every": loop.sync_every,
        "fragments": loop.streaming.fragments,
        "overlap": loop.outer.overlap,
        "outer_optimizer": loop.outer.optimizer,
        "codec": loop.codec.name,
        "error_feedback": loop.codec.error_feedback,
        "shards": 1 if shards is None else shards.count,
        "trainers": loop.trainers,
        "merge": (loop.merge.policy, loop.merge.every, loop.merge.group_size),
        **({"batch": (loop.batch.size, loop.batch.test, loop.batch.controller)} if adaptive else {}),
    }
