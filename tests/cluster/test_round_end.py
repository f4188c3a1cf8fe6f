"""The round's end both drivers call (``adloco.cluster.round_end``): its order, and the dispersion it gives each
trainer taking part (a sharded worker's summed over its shards)."""

import math
from types import SimpleNamespace

import pytest

from adloco.algorithms.sync_every import SyncDecision, dispersion
from adloco.cluster import round_end
from adloco.cluster.round_end import RoundEnd
from adloco.sync.exchange import Drift
from adloco.workers.reports import RoundState, WorkerRound

pytestmark = pytest.mark.unit

DRIFT = Drift(worker_sq={0: 4.0, 1: 1.0}, mean_sq=2.0)


class _Sync:
    """A strategy that records what the round's end asks of it."""

    def __init__(self, calls: list[str], trainers: list) -> None:
        self.calls, self.trainers = calls, trainers

    def end_of_round(self, state: RoundState) -> None:
        self.calls.append("exchange")
        state.reports = dict(state.local)

    def taking_part(self) -> list:
        return self.trainers[:1]  # the second trainer's workers are on another rank

    def take_drift(self, trainer_id: int) -> Drift:
        self.calls.append(f"drift {trainer_id}")
        return DRIFT


class _Batch:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def decide(self, state: RoundState, trainers: list) -> None:
        self.calls.append(f"decide {[t.trainer_id for t in trainers]} δ={trainers[0].dispersion:.4f}")

    def learn(self, state: RoundState) -> None:
        self.calls.append("learn")

    def pinned_seconds(self) -> tuple[float, float]:
        return (0.5, 2.0)


class _Length:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def choose(self, state: RoundState, trainers, pinned) -> SyncDecision:
        self.calls.append(f"choose {sorted(t.trainer_id for t in trainers)} pinned={pinned}")
        step, exchange = pinned or (math.nan, math.nan)
        return SyncDecision(8, math.nan, "fixed", step, exchange, math.nan, math.nan, math.nan)


def _round(calls: list[str], shard_sum=None) -> tuple[RoundEnd, dict, RoundState]:
    trainers = {k: SimpleNamespace(trainer_id=k, dispersion=math.nan) for k in (0, 1)}
    comm = SimpleNamespace(world_size=1)  # one rank: nothing to share
    end = RoundEnd(_Sync(calls, list(trainers.values())), comm, trainers, lambda s: calls.append("restart"), shard_sum)
    state = RoundState(index=0, steps=2, first_step=0, statistics_due=True, local={0: WorkerRound(), 1: WorkerRound()})
    return end, trainers, state


def test_the_round_ends_in_one_order_for_every_driver(monkeypatch):
    """Exchange, restart of the failed workers, dispersion, batch decisions of the trainers taking part, every
    trainer's state and reports to every rank, the costs learned, then H from every trainer with the batch's pinned
    costs: the order both drivers rely on (the batch weighs b at the dispersion just measured; the costs are learned
    from every trainer's reports; H follows the b just decided)."""
    calls: list[str] = []
    monkeypatch.setattr(round_end, "synchronize", lambda comm, trainers, state: calls.append("synchronize"))
    end, trainers, state = _round(calls)
    decision = end(state, _Batch(calls), _Length(calls))
    expected = dispersion(DRIFT.worker_sq, DRIFT.mean_sq)
    assert calls == [
        "exchange",
        "restart",
        "drift 0",
        f"decide [0] δ={expected:.4f}",
        "synchronize",
        "learn",
        "choose [0, 1] pinned=(0.5, 2.0)",
    ]
    assert trainers[0].dispersion == expected and math.isnan(trainers[1].dispersion)
    assert decision.sync_every == 8 and end.exchange_seconds >= 0.0


def test_without_a_batch_side_h_is_chosen_on_the_reports_own_costs():
    calls: list[str] = []
    end, _, state = _round(calls)
    length = _Length(calls)
    length.choose = lambda state, trainers, pinned: calls.append(f"pinned={pinned}")  # type: ignore[method-assign]
    end(state, None, length)
    assert calls[-1] == "pinned=None" and not any(c.startswith(("decide", "learn")) for c in calls)


def test_a_sharded_workers_dispersion_is_that_of_its_norms_summed_over_its_shards():
    """Each shard holds part of every squared norm; the dispersion is of the sums, not of one shard's parts."""
    sums: list[tuple[list[float], float]] = []

    def two_shards(worker_sq, mean_sq):
        sums.append((list(worker_sq), mean_sq))
        return [worker_sq[0] + 1.0, worker_sq[1] + 3.0], mean_sq + 0.5  # plus the other shard's parts

    end, trainers, state = _round([], two_shards)
    end(state, None, _Length([]))
    assert sums == [([4.0, 1.0], 2.0)]  # the workers' in their order, and the mean's
    assert trainers[0].dispersion == dispersion({0: 5.0, 1: 4.0}, 2.5)
    assert trainers[0].dispersion != dispersion(DRIFT.worker_sq, DRIFT.mean_sq)
