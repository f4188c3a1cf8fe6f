"""The pseudo-gradient exchange: means over the healthy workers, with and without a codec."""

import torch

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.algorithms.codecs import get_codec
from adloco.batch.policy import TrainerBatch
from adloco.comm.local import LocalCommunicator
from adloco.sync import DeltaExchange, WorkerRound
from adloco.sync.trainer import Trainer


class _Slot:
    def __init__(self, value):
        self.params = [torch.full((4,), value)]


def _trainer():
    return Trainer(
        0, [torch.zeros(4)], [0, 1, 2], TrainerBatch(1, BatchSizeController("constant", b_cap=1)), 1.0, 0.0, False
    )


def _reports(out):
    return {w: WorkerRound(out=w in out).to_tensor() for w in range(3)}


def test_the_mean_is_over_the_workers_not_out():
    comm = LocalCommunicator()
    slots = {0: _Slot(-1.0), 1: _Slot(-2.0), 2: _Slot(float("nan"))}  # worker 2 went non-finite
    exchange = DeltaExchange(comm, None, False, [0, 1, 2])
    done = comm.wait(exchange.start(_trainer(), 0, slots, {2}, reports=_reports({2})))
    assert torch.equal(done.mean[0], torch.full((4,), 1.5))
    assert set(done.reports) == {0, 1, 2} and WorkerRound.from_tensor(done.reports[2]).out
    assert comm.stats.exchanges == 1 and comm.stats.bytes_sent > 3 * 4 * 4


def test_a_known_healthy_count_needs_no_reports_and_a_codec_decodes_the_same_mean():
    comm = LocalCommunicator()
    slots = {0: _Slot(-1.0), 1: _Slot(-2.0), 2: _Slot(-3.0)}
    plain = DeltaExchange(comm, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), healthy=3)
    coded = DeltaExchange(comm, get_codec("bf16"), False, [0, 1, 2]).start(_trainer(), 0, slots, set(), healthy=3)
    assert torch.equal(comm.wait(plain).mean[0], torch.full((4,), 2.0))
    assert torch.equal(comm.wait(coded).mean[0], torch.full((4,), 2.0))  # 1, 2, 3 are exact in bf16
    assert comm.wait(plain).reports == {}


def test_sample_weights_weigh_each_delta_and_the_divisor_counts_only_healthy_weight():
    comm = LocalCommunicator()
    slots = {0: _Slot(-1.0), 1: _Slot(-2.0), 2: _Slot(float("nan"))}  # Δ = 1 and 2; worker 2 is out
    weights = {0: 1.5, 1: 0.5, 2: 1.0}
    for codec in (None, get_codec("bf16")):
        exchange = DeltaExchange(comm, codec, False, [0, 1, 2])
        done = comm.wait(exchange.start(_trainer(), 0, slots, {2}, reports=_reports({2}), weights=weights))
        assert torch.equal(done.mean[0], torch.full((4,), (1.5 * 1 + 0.5 * 2) / 2.0))


def test_unit_weights_give_the_unweighted_mean_bit_for_bit():
    comm = LocalCommunicator()
    torch.manual_seed(0)
    slots = {w: _Slot(0.0) for w in range(3)}
    for slot in slots.values():
        slot.params = [torch.randn(4)]
    plain = comm.wait(DeltaExchange(comm, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), healthy=3))
    ones = dict.fromkeys(range(3), 1.0)
    unit = comm.wait(
        DeltaExchange(comm, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), healthy=3.0, weights=ones)
    )
    assert torch.equal(plain.mean[0], unit.mean[0])


def test_each_workers_drift_rides_in_its_report_and_the_mean_drift_comes_back():
    comm = LocalCommunicator()
    slots = {0: _Slot(-1.0), 1: _Slot(-3.0), 2: _Slot(float("nan"))}  # Δ = 1 and 3 on 4 elements; worker 2 out
    for codec in (None, get_codec("bf16")):
        done = comm.wait(DeltaExchange(comm, codec, False, [0, 1, 2]).start(_trainer(), 0, slots, {2}, _reports({2})))
        assert done.drift.worker_sq == {0: 4.0, 1: 36.0}  # the out worker is left out
        assert done.drift.mean_sq == 16.0  # mean Δ = 2 on 4 elements
        assert all(WorkerRound.from_tensor(r).b_max == 0 for r in done.reports.values())  # the report is intact
    # Without reports the healthy workers are those that sent a drift
    known = comm.wait(DeltaExchange(comm, None, False, [0, 1, 2]).start(_trainer(), 0, slots, {2}, healthy=2))
    assert known.drift.worker_sq == {0: 4.0, 1: 36.0} and known.reports == {}


class _EveryoneGone(LocalCommunicator):
    """A fault-tolerant transport whose exchange failed on every try: every worker reads as absent."""

    def absent_from_last(self):
        return frozenset({0, 1, 2})


def test_an_exchange_nobody_was_present_at_is_dropped_and_changes_no_fragment():
    from adloco.config.sections import StreamingConfig
    from adloco.sync.streaming import StreamingSync

    slots = {0: _Slot(-1.0), 1: _Slot(-2.0), 2: _Slot(-3.0)}
    gone = _EveryoneGone()
    dropped = gone.wait(DeltaExchange(gone, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), _reports(())))
    comm = LocalCommunicator()
    done = comm.wait(DeltaExchange(comm, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), _reports(())))
    assert dropped.dropped and not done.dropped
    trainer = _trainer()
    stream = StreamingConfig(fragments=1, overlap=0, alpha=0.0)
    sync = StreamingSync(comm, {0: trainer}, slots, DeltaExchange(comm, None, False, [0, 1, 2]), stream=stream,
                         sync_every=4)  # fmt: skip
    sync._apply(trainer, 0, dropped, alpha=0.0)
    assert torch.equal(trainer.theta[0], torch.zeros(4)) and torch.equal(slots[0].params[0], torch.full((4,), -1.0))
    sync._apply(trainer, 0, done, alpha=0.0)
    assert torch.equal(trainer.theta[0], torch.full((4,), -2.0))  # outer SGD lr 1, no momentum: θ − mean Δ


def test_an_eager_worker_takes_back_its_share_of_a_dropped_exchange():
    """Overlapped DiLoCo with eager updates: a worker steps its own copy with its share of the mean at once; when
    that exchange is dropped (every try failed) no mean arrives a round later, and its share comes back out."""
    from adloco.config.sections import OuterConfig
    from adloco.sync.overlapped import EagerCopy, OverlappedSync

    slots = {0: _Slot(-1.0), 1: _Slot(-2.0), 2: _Slot(-3.0)}
    gone = _EveryoneGone()
    sync = OverlappedSync(gone, {0: _trainer()}, slots, DeltaExchange(gone, None, False, [0, 1, 2]),
                          outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False), eager=True)  # fmt: skip
    dropped = DeltaExchange(gone, None, False, [0, 1, 2]).start(_trainer(), 0, slots, set(), _reports(()))
    assert sync._arrived(sync.trainers[0], dropped) is None  # no outer step takes a dropped mean
    copy = EagerCopy([torch.zeros(4)], lr=1.0, momentum=0.0, nesterov=False, factory=None)
    copy.step(None, [torch.full((4,), 0.5)])  # round 1: its own share of the mean in flight, applied at once
    assert torch.equal(copy.theta[0], torch.full((4,), -0.5))
    copy.step(None, [torch.full((4,), 0.25)])  # round 1's exchange dropped: its share out, round 2's in
    assert torch.equal(copy.theta[0], torch.full((4,), -0.25))
