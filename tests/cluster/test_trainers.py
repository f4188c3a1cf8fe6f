"""Merging trainers (AdLoCo's merge) keeps every outer optimizer's state, not only SGD's momentum."""

import torch

from adloco.algorithms.batch_tests import BatchSizeController
from adloco.algorithms.outer import adam_factory
from adloco.batch.policy import TrainerBatch
from adloco.cluster.trainers import maybe_merge
from adloco.comm.local import LocalCommunicator
from adloco.config import MergeConfig
from adloco.sync.trainer import Trainer


def _trainer(trainer_id: int, b: int, factory=None) -> Trainer:
    batch = TrainerBatch(b, BatchSizeController("constant", b_cap=64))
    return Trainer(trainer_id, [torch.zeros(2)], [trainer_id], batch, 0.7, 0.9, True, outer_factory=factory)


def _merged(factory, deltas):
    trainers = {k: _trainer(k, b, factory) for k, b in ((0, 1), (1, 3))}
    for trainer, delta in zip(trainers.values(), deltas, strict=True):
        trainer.outer_step(0, [delta])
    expected = {k: {n: t.clone() for n, t in trainers[k].outers[0].optimizer.state[trainers[k].theta[0]].items()}
                for k in trainers}  # fmt: skip
    merge = MergeConfig(policy="b_req", every=1, group_size=2)
    event = maybe_merge(LocalCommunicator(), trainers, {}, merge, round_index=0)
    assert event is not None and list(trainers) == [0]
    return trainers[0].outers[0].optimizer.state[trainers[0].theta[0]], expected


def test_a_merge_averages_outer_momentum_with_the_merge_weights():
    state, before = _merged(None, [torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 4.0])])
    expected = 0.25 * before[0]["momentum_buffer"] + 0.75 * before[1]["momentum_buffer"]
    assert torch.allclose(state["momentum_buffer"], expected, rtol=0, atol=1e-7)


def test_a_merge_averages_both_adam_moments_and_keeps_the_step_count():
    state, before = _merged(adam_factory(0.01, (0.9, 0.95), 1e-8), [torch.tensor([1.0, 2.0]), torch.tensor([-3.0, 4])])
    for name in ("exp_avg", "exp_avg_sq"):
        expected = 0.25 * before[0][name] + 0.75 * before[1][name]
        assert torch.allclose(state[name], expected, rtol=0, atol=1e-7)
    assert float(state["step"]) == 1.0
