"""Streaming DiLoCo (arXiv 2501.18512): P parameter fragments, each synced once per round at its own offset.

Fragment p sends its Δ_p at inner step t_p of every round (t_p = p·H/P, fragment 0 at the round's end) and
applies it τ steps later:
θ̃_p = OuterOpt_p(θ_p, Δ_p), then every worker's fragment becomes α·local + (1 − α)·θ̃_p. Peak traffic is one
fragment instead of the whole model, and the exchange overlaps τ inner steps. The round boundary gathers the
workers' reports only (who was healthy, their losses and statistics); each fragment exchange carries the
health flags it needs to average over the healthy workers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.futures import Future

from adloco.algorithms.fragments import assign_fragments, mix
from adloco.algorithms.schedules import fragments_sending_at
from adloco.config import ConfigError, StreamingConfig
from adloco.sync.base import DeltaStrategy, completed, pending_item
from adloco.sync.exchange import Exchanged
from adloco.sync.trainer import Trainer
from adloco.workers.reports import RoundState


class StreamingSync(DeltaStrategy):
    saves_worker_params = True  # between syncs a worker's fragments are its own, not θ's

    def __init__(self, *parts: Any, stream: StreamingConfig, sync_every: int) -> None:
        """``parts``: DeltaStrategy's (comm, trainers, workers, exchange); the config's ``streaming`` section and H."""
        super().__init__(*parts)
        assert stream.fragments is not None and stream.overlap is not None and stream.alpha is not None
        self.stream, self.sync_every = stream, sync_every
        # (trainer, fragment) -> (global step at which it is applied, future of the mean Δ_p)
        self.pending: dict[tuple[int, int], tuple[int, Future]] = {}

    def after_inner_step(self, state: RoundState, step: int) -> None:
        """Inner step ``step`` of the round: start the fragments due to send, apply those sent τ steps ago."""
        stream = self.stream
        assert stream.fragments is not None and stream.overlap is not None and stream.alpha is not None
        t = state.first_step + step + 1  # the global inner step (1-based) at which exchanges are due
        sync_every = state.sync_every or self.sync_every  # the round's H: sync_every=auto moves it between rounds
        for trainer in self.taking_part():
            flags = {w: torch.tensor([float(state.local[w].out)], dtype=torch.float64) for w in self.hosted(trainer)}
            for p in fragments_sending_at(step + 1, sync_every, stream.fragments):
                future = self.exchange.start(trainer, p, self.workers, state.out, reports=flags, weights=state.weights)
                self.pending[(trainer.trainer_id, p)] = (t + stream.overlap, future)
        for trainer in self.taking_part():
            key = trainer.trainer_id
            for p in sorted(p for (k, p), (due, _) in self.pending.items() if k == key and due == t):
                _, future = self.pending.pop((key, p))
                self._apply(trainer, p, self.comm.wait(future), stream.alpha)

    @torch.no_grad()
    def _apply(self, trainer: Trainer, index: int, exchanged: Exchanged, alpha: float) -> None:
        """θ_p ← OuterOpt_p(θ_p, Δ_p); hosted workers' fragment ← α·local + (1 − α)·θ_p. A dropped exchange (a
        fault-tolerant one that failed) changes nothing: the fragment's drift goes into its next."""
        if exchanged.dropped:
            return
        trainer.outer_step(index, self.applied(trainer, exchanged))
        for worker_id in self.hosted(trainer):
            params = self.workers[worker_id].params
            for i in trainer.fragments[index]:
                params[i].copy_(mix(params[i], trainer.theta[i].to(params[i].device), alpha))

    def end_of_round(self, state: RoundState) -> None:
        for trainer in self.taking_part():
            self.gather_reports(state, trainer)
            if self.mark_skipped(state, trainer):
                trainer.broadcast(self.workers)  # every worker failed: all restart from θ
                continue
            for worker_id in self.hosted(trainer):
                if state.reports[worker_id].out:  # its fragments may hold NaN: it restarts from θ
                    self.workers[worker_id].load_params(trainer.theta)

    def flush(self) -> None:
        alpha = self.stream.alpha or 0.0
        for key in sorted(self.pending):
            _, future = self.pending.pop(key)
            self._apply(self.trainers[key[0]], key[1], self.comm.wait(future), alpha)

    def state_dict(self) -> dict:
        return {f"{k}/{p}": pending_item(due, future.wait()) for (k, p), (due, future) in self.pending.items()}

    def load_state_dict(self, pending: dict) -> None:
        self.pending = {}
        for key, item in pending.items():
            trainer_id, fragment = (int(x) for x in key.split("/"))
            self.pending[(trainer_id, fragment)] = (int(item["due"]), completed(item))


def parameter_fragments(stream: StreamingConfig, names: list[str]) -> list[list[int]] | None:
    """The parameter fragments that sync in turn, by the parameters' ``names``; None: one fragment, the whole model."""
    if stream.fragments is None or stream.fragments == 1:
        return None
    try:
        return assign_fragments(names, stream.fragments, stream.assignment, stream.shared)
    except ValueError as error:
        raise ConfigError(str(error)) from None
