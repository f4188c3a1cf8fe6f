"""The hooks every sync strategy answers, and what the DiLoCo family shares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adloco.comm.base import Communicator
from adloco.sync.exchange import DeltaExchange, Drift, Exchanged
from adloco.sync.trainer import Trainer
from adloco.workers.reports import RoundState, absent_report
from adloco.workers.worker import Worker


class SyncStrategy:
    """Who talks when, for one method family. The cluster calls the hooks in this order every inner step
    (``after_backward``, then the optimizer steps it allows, then ``after_inner_step``) and ``end_of_round``
    once at the round boundary; ``flush`` at the end of training."""

    saves_worker_params = False  # whether a worker's parameters can differ from θ at a round boundary

    def __init__(self, comm: Communicator, trainers: dict[int, Trainer], workers: Mapping[int, Worker]) -> None:
        self.comm = comm
        self.trainers = trainers  # the cluster's own dict: merges remove trainers from it
        self.workers = workers

    def hosted(self, trainer: Trainer) -> list[int]:
        return [w for w in trainer.worker_ids if w in self.workers]

    def taking_part(self) -> list[Trainer]:
        """Trainers with a worker on this rank; the others' state arrives with the cluster's synchronize. Where
        every rank holds every trainer (fault-tolerant replicas), every trainer, this rank's own first: the others
        read the rows of its exchanges."""
        if getattr(self.comm, "holds_every_trainer", False):
            return sorted(self.trainers.values(), key=lambda t: not self.hosted(t))  # stable: then by id
        return [t for t in self.trainers.values() if self.hosted(t)]

    def after_backward(self, state: RoundState, step: int) -> set[int]:
        """Exchanges between backward and the optimizer step; returns the hosted workers that step now.

        DiLoCo family: a worker whose loss or gradient is not finite sits out the rest of the round, locally:
        the others learn it from its report at the round boundary.
        """
        for record in state.local.values():
            if not record.steps[step].finite:
                record.out = True
        return {w for w, record in state.local.items() if not record.out}

    def after_inner_step(self, state: RoundState, step: int) -> None:
        """Exchanges due after inner step ``step`` of the round (streaming fragments)."""

    def end_of_round(self, state: RoundState) -> None:
        """The round's exchanges and outer steps; afterwards ``state.reports`` holds every worker of the
        trainers this rank takes part in, and ``state.skipped`` the trainers that made no progress."""
        raise NotImplementedError

    def flush(self) -> None:
        """Apply whatever is still in flight (end of training)."""

    def take_drift(self, trainer_id: int) -> Drift:
        """The workers' drift in the exchanges applied since the last call (none: no exchange of Δ)."""
        return Drift()

    @property
    def peak_sync_bytes(self) -> int:
        return 0

    def worker_state(self, worker_id: int) -> dict:
        """Per-worker outer state for the checkpoint (stored beside the worker's inner state)."""
        return {}

    def load_worker_state(self, worker_id: int, state: dict) -> None:
        pass

    def join_worker(self, worker_id: int) -> None:
        """Worker ``worker_id`` took its trainer's state from a peer (a replica's heal): its own per-worker outer
        state, if the strategy keeps any, starts from the trainer's."""

    def state_dict(self) -> dict:
        """Exchanges in flight, keyed ``"trainer/fragment"``: the step at which each is applied and its Δ."""
        return {}

    def load_state_dict(self, pending: dict) -> None:
        pass


class DeltaStrategy(SyncStrategy):
    """The DiLoCo family: workers drift for H steps, then exchange pseudo-gradients Δ (maybe quantized)."""

    def __init__(
        self, comm: Communicator, trainers: dict[int, Trainer], workers: Mapping[int, Worker], exchange: DeltaExchange
    ) -> None:
        super().__init__(comm, trainers, workers)
        self.exchange = exchange
        self.drift: dict[int, Drift] = {}  # per trainer, over the exchanges applied since take_drift

    def applied(self, trainer: Trainer, exchanged: Exchanged) -> list[torch.Tensor]:
        """Note an exchange's drift as its mean is applied; returns the mean."""
        self.drift.setdefault(trainer.trainer_id, Drift()).add(exchanged.drift)
        return exchanged.mean

    def take_drift(self, trainer_id: int) -> Drift:
        return self.drift.pop(trainer_id, Drift())

    @property
    def peak_sync_bytes(self) -> int:
        return self.exchange.peak_sync_bytes

    def gather_reports(self, state: RoundState, trainer: Trainer) -> None:
        """A round boundary whose Δ is not waited for now still has to tell every rank who did what."""
        local = state.local_tensors(self.hosted(trainer))
        gathered = self.comm.wait(self.comm.gather_with_reports({w: [] for w in local}, local, trainer.worker_ids))
        width = next(iter(local.values())).numel() if local else gathered.report_width
        state.learn(gathered.reports_with_absent(absent_report(width)))

    def mark_skipped(self, state: RoundState, trainer: Trainer) -> bool:
        """Every worker of the trainer sat out: no outer step from this round."""
        if all(state.reports[w].out for w in trainer.worker_ids):
            state.skipped.add(trainer.trainer_id)
            return True
        return False

    def worker_state(self, worker_id: int) -> dict:
        return {"error_feedback": self.exchange.worker_state(worker_id)}

    def load_worker_state(self, worker_id: int, state: dict) -> None:
        self.exchange.load_worker_state(worker_id, state["error_feedback"])


def pending_item(due: int, exchanged: Exchanged) -> dict[str, Any]:
    """An exchange in flight as a state keeps it: the step it is applied at, its mean, and what a replica that
    heals from this state must apply alike: whether it was dropped, and the workers' drift in it (which
    ``sync_every=auto`` reads at the round's end)."""
    drift = {"worker_sq": dict(exchanged.drift.worker_sq), "mean_sq": exchanged.drift.mean_sq}
    return {"due": due, "delta": exchanged.mean, "drift": drift, "dropped": exchanged.dropped}


def completed(item: dict[str, Any]) -> torch.futures.Future:
    """An exchange that is already done, from its ``pending_item``."""
    drift = item["drift"]
    exchanged = Exchanged(
        mean=list(item["delta"]),
        reports={},
        drift=Drift({int(w): float(sq) for w, sq in drift["worker_sq"].items()}, drift["mean_sq"]),
        dropped=bool(item["dropped"]),
    )
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(exchanged)
    return future
