"""Whole-round overlap for DiLoCo: delayed outer steps and eager updates (arXiv 2502.12996)."""

import pytest
import torch

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.batch.policy import TrainerBatch
from adloco.comm.local import LocalCommunicator
from adloco.config import ConfigError, build_config
from adloco.metrics.writer import read_metrics
from adloco.run.training import train
from adloco.sync import DeltaExchange, OverlappedSync, RoundState, StepRecord, WorkerRound
from adloco.sync.trainer import Trainer
from tests.conftest import cut_back, final_params, same_params


class _Slot:
    """The part of a worker the outer step touches: its parameters."""

    def __init__(self, theta):
        self.params = [t.clone() for t in theta]

    def load_params(self, theta):
        for p, t in zip(self.params, theta, strict=True):
            p.copy_(t)


def _eager_strategy(theta):
    """The eager strategy over two in-process workers, outer SGD lr 1 without momentum."""
    config = build_config(overrides=["method=diloco", "outer.overlap=eager", "outer.lr=1.0", "outer.momentum=0.0"])
    batch = TrainerBatch(1, BatchSizeController(test="constant", b_cap=1))
    trainer = Trainer(0, theta, [0, 1], batch, 1.0, 0.0, False)
    comm = LocalCommunicator()
    slots = {0: _Slot(theta), 1: _Slot(theta)}
    exchange = DeltaExchange(comm, None, False, [0, 1])
    sync = OverlappedSync(comm, {0: trainer}, slots, exchange, outer=config.outer, eager=True)
    return trainer, sync, slots


def _round(sync, slots, ends):
    """Workers end a round at ``ends`` (relative to where each started); then the eager round boundary."""
    for worker_id, slot in slots.items():
        slot.params[0].add_(torch.tensor([ends[worker_id]]))
    state = RoundState(index=0, steps=1, first_step=0, statistics_due=False)
    state.local = {w: WorkerRound(steps=[StepRecord(loss=1.0, tokens=1, finite=True)]) for w in slots}
    sync.end_of_round(state)


def test_eager_outer_steps_by_hand():
    """Two workers, scalar θ₀ = 0, outer SGD lr 1: each worker swaps its stale share for its fresh one."""
    trainer, sync, slots = _eager_strategy([torch.zeros(1)])
    # Round 1: Δ = 2 and 4; nothing has arrived yet, each worker applies only its own share (1 and 2).
    _round(sync, slots, {0: -2.0, 1: -4.0})
    assert trainer.theta[0].item() == 0.0
    assert [slots[w].params[0].item() for w in (0, 1)] == [-1.0, -2.0]
    # Round 2: Δ = 1 and 3 from their own starts; round 1's mean 3 arrives and θ takes it.
    _round(sync, slots, {0: -1.0, 1: -3.0})
    assert trainer.theta[0].item() == -3.0
    # worker 0: 3 − 1 + 0.5 = 2.5 from −1; worker 1: 3 − 2 + 1.5 = 2.5 from −2
    assert [slots[w].params[0].item() for w in (0, 1)] == [-3.5, -4.5]
    sync.flush()  # end of training: the last mean lands
    assert trainer.theta[0].item() == -5.0


@pytest.mark.training
def test_eager_with_one_worker_is_diloco_bit_for_bit(fast_overrides):
    base = [*fast_overrides, "method=diloco", "workers=1"]
    plain = train(build_config(overrides=base))
    eager = train(build_config(overrides=[*base, "outer.overlap=eager"]))
    assert same_params(final_params(plain.run_dir), final_params(eager.run_dir))


@pytest.mark.training
def test_overlap_sends_the_same_bytes_and_changes_the_trajectory(fast_overrides):
    runs = {
        mode: train(build_config(overrides=[*fast_overrides, "method=diloco", f"outer.overlap={mode}"]))
        for mode in ("none", "delayed", "eager")
    }
    rounds = {
        m: [r for r in read_metrics(r.run_dir / "metrics.jsonl") if r["kind"] == "round"] for m, r in runs.items()
    }
    assert (
        [r["bytes"] for r in rounds["eager"]]
        == [r["bytes"] for r in rounds["none"]]
        == [r["bytes"] for r in rounds["delayed"]]
    )
    params = {m: final_params(r.run_dir) for m, r in runs.items()}
    assert not same_params(params["none"], params["delayed"])
    assert not same_params(params["delayed"], params["eager"])
    assert all(torch.isfinite(t).all() for p in params.values() for t in p.values())
    # The first round's outer step waits for nothing: θ is unchanged until the first exchange lands.
    assert rounds["delayed"][0]["train_loss"] == rounds["none"][0]["train_loss"]


@pytest.mark.training
@pytest.mark.parametrize(("mode", "checkpoint_format"), [("delayed", "file"), ("eager", "file"), ("eager", "sharded")])
def test_resume_with_an_exchange_in_flight_is_bit_identical(mode, checkpoint_format, fast_overrides, tmp_path):
    overrides = [*fast_overrides, "method=diloco", f"outer.overlap={mode}", "checkpoint.every=1", "checkpoint.keep=9"]
    overrides.append(f"checkpoint.format={checkpoint_format}")
    config = build_config(overrides=overrides)
    full = train(config)
    partial = cut_back(full.run_dir, tmp_path / "partial", keep=2)
    train(config, resume=partial)
    assert same_params(final_params(full.run_dir), final_params(partial))


@pytest.mark.parametrize("method", ["adloco", "streaming", "ddp"])
def test_overlap_is_for_whole_model_diloco(method):
    with pytest.raises(ConfigError, match="outer.overlap"):
        build_config(overrides=[f"method={method}", "outer.overlap=eager"])
