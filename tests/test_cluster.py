"""The cluster: trainers, their workers and what a round does with them (in one process)."""

import pytest
import torch

from adloco.cluster import Cluster
from adloco.comm import LocalCommunicator
from adloco.config import build_config
from adloco.training import _tokenizer_and_task

TINY = ["model.context=16", "batch.size=3", "batch.b_max=64", "threads=1", "run.progress=false"]


def _cluster(overrides: list[str]) -> Cluster:
    config = build_config(overrides=[*TINY, *overrides])
    _, task = _tokenizer_and_task(config, None)
    return Cluster(config, task, LocalCommunicator(), torch.device("cpu"))


@pytest.mark.parametrize(
    ("scaling", "b", "lr_factor", "beta2"),
    [
        ("sqrt", 12, 2.0, 0.99**4),  # (12/3)^0.5; β2^(12/3)
        ("linear", 6, 2.0, 0.99**2),
        ("sqrt", 3, 1.0, 0.99),  # the starting batch: the configured settings exactly
        ("none", 12, 1.0, 0.99**4),
    ],
)
def test_a_trainers_batch_sets_its_workers_inner_lr_and_beta2(scaling, b, lr_factor, beta2):
    cluster = _cluster(["method=diloco", "workers=2", "sync_every=2", f"batch.lr_scaling={scaling}"])
    (trainer,) = cluster.trainers.values()
    trainer.batch_size = b
    cluster.run_round(0, 2, lambda step: 1e-3)
    for worker in cluster.workers.values():
        for group in worker.optimizer.param_groups:
            assert group["lr"] == pytest.approx(1e-3 * lr_factor, rel=1e-12)
            assert group["betas"] == (0.9, pytest.approx(beta2, rel=1e-12))


def test_the_coupling_can_be_turned_off():
    cluster = _cluster(["method=diloco", "workers=1", "batch.lr_scaling=none", "batch.beta2_scaling=false"])
    (trainer,) = cluster.trainers.values()
    trainer.batch_size = 48
    cluster.run_round(0, 1, lambda step: 1e-3)
    (worker,) = cluster.workers.values()
    assert [(g["lr"], g["betas"]) for g in worker.optimizer.param_groups] == [(1e-3, (0.9, 0.99))] * 2
