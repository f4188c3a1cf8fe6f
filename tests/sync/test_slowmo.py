"""SlowMo (``method=slowmo``, arXiv 1910.00643), a method added through the registry alone: it trains, and its
outer step is heavy-ball momentum over the averaged drift, not DiLoCo's Nesterov."""

import torch

from adloco.cluster.cluster import Cluster
from adloco.comm.local import LocalCommunicator
from adloco.config import build_config
from adloco.run.training import tokenizer_and_task
from adloco.sync import DiLoCoSync

TINY = ["model.context=16", "batch.size=2", "batch.memory.b_max=64", "threads=1", "run.progress=false", "workers=2"]


def _cluster(overrides: list[str]) -> Cluster:
    config = build_config(overrides=[*TINY, *overrides])
    _, task = tokenizer_and_task(config, None)
    return Cluster(config, task, LocalCommunicator(), torch.device("cpu"))


def test_slowmo_resolves_to_slow_heavy_ball_momentum_and_stays_tunable():
    config = build_config(overrides=["method=slowmo"])
    assert (config.outer.optimizer, config.outer.lr, config.outer.momentum, config.outer.nesterov) == (
        "sgd",
        1.0,
        0.5,
        False,
    )
    tuned = build_config(overrides=["method=slowmo", "outer.momentum=0.7", "outer.lr=0.9"])  # unlike localsgd's
    assert (tuned.outer.lr, tuned.outer.momentum) == (0.9, 0.7)


def test_slowmo_trains_and_each_outer_step_is_heavy_ball():
    cluster = _cluster(["method=slowmo", "sync_every=4"])
    assert type(cluster.sync) is DiLoCoSync  # the DiLoCo family's strategy: nothing new in sync/
    (trainer,) = cluster.trainers.values()
    losses = []
    for round_index in range(4):
        before = [t.clone() for t in trainer.theta]
        report = cluster.run_round(round_index, 4, lambda step: 1e-2)
        losses.append(report.loss[trainer.trainer_id])
        buffers = trainer.outers[0].momentum_buffers()
        # heavy ball with lr 1: θ ← θ − buf, buf ← 0.5·buf + Δ (Nesterov would step by Δ + 0.5·buf)
        for theta, old, buffer in zip(trainer.theta, before, buffers, strict=True):
            assert buffer is not None and torch.equal(theta, old.add(buffer, alpha=-1.0))
    assert all(torch.isfinite(t).all() for t in trainer.theta)
    assert losses[-1] < losses[0] - 0.1, losses  # it learns: the tiny model's loss falls over 16 inner steps
