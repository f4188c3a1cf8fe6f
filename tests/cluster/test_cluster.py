"""The cluster: trainers, their workers and what a round does with them (in one process)."""

import pytest
import torch

from adloco.checkpoint import CheckpointError
from adloco.cluster.cluster import Cluster
from adloco.comm.local import LocalCommunicator
from adloco.config import ConfigError, build_config
from adloco.run.training import tokenizer_and_task
from adloco.workers.group import WorkerGroup
from tests.conftest import PINNED_PACE as PINNED

TINY = ["model.context=16", "batch.size=3", "batch.memory.b_max=64", "threads=1", "run.progress=false"]


def _cluster(overrides: list[str]) -> Cluster:
    config = build_config(overrides=[*TINY, *overrides])
    _, task = tokenizer_and_task(config, None)
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
    cluster = _cluster(["method=diloco", "workers=2", "sync_every=2", f"batch.scaling.lr={scaling}"])
    (trainer,) = cluster.trainers.values()
    trainer.batch_size = b
    cluster.run_round(0, 2, lambda step: 1e-3)
    for worker in cluster.workers.values():
        for group in worker.optimizer.param_groups:
            assert group["lr"] == pytest.approx(1e-3 * lr_factor, rel=1e-12)
            assert group["betas"] == (0.9, pytest.approx(beta2, rel=1e-12))


def test_with_muon_the_batch_scales_both_lrs_and_only_adamws_beta2():
    """Muon's update is orthogonalized (its size is set by the lr, not by a second moment), so a larger batch
    moves its lr as it moves AdamW's, and β2 (AdamW's alone) keeps its half-life in samples."""
    cluster = _cluster(["method=diloco", "workers=1", "inner.optimizer=muon", "inner.muon_lr=2e-3"])
    (trainer,) = cluster.trainers.values()
    trainer.batch_size = 12
    cluster.run_round(0, 1, lambda step: 1e-3)
    (worker,) = cluster.workers.values()
    muon, *adamw = worker.optimizer.param_groups
    assert muon["lr"] == pytest.approx(2e-3 * 2.0, rel=1e-12) and "betas" not in muon
    assert all(g["lr"] == pytest.approx(1e-3 * 2.0) and g["betas"][1] == pytest.approx(0.99**4) for g in adamw)


def test_the_coupling_can_be_turned_off():
    cluster = _cluster(["method=diloco", "workers=1", "batch.scaling.lr=none", "batch.scaling.beta2=false"])
    (trainer,) = cluster.trainers.values()
    trainer.batch_size = 48
    cluster.run_round(0, 1, lambda step: 1e-3)
    (worker,) = cluster.workers.values()
    assert [(g["lr"], g["betas"]) for g in worker.optimizer.param_groups] == [(1e-3, (0.9, 0.99))] * 2


SLOW_SECOND = ["batch.shares=speed", "batch.time.step_seconds=[[0.0,0.01],[0.0,0.03]]", "batch.size=4"]


def _theta_after_one_round(cluster: Cluster) -> tuple[list[torch.Tensor], dict[int, list[torch.Tensor]]]:
    """θ after one round of one step, and each worker's parameters just before the round's exchange."""
    before_exchange = {}
    end_of_round = cluster.sync.end_of_round

    def snapshot_then_exchange(state):
        before_exchange.update({w: [p.detach().clone() for p in wk.params] for w, wk in cluster.workers.items()})
        end_of_round(state)

    cluster.sync.end_of_round = snapshot_then_exchange
    cluster.run_round(0, 1, lambda step: 1e-3)
    (trainer,) = cluster.trainers.values()
    return trainer.theta, before_exchange


def test_speed_shares_give_the_faster_worker_more_samples_and_weigh_its_delta_by_them():
    # LocalSGD's outer step is θ ← θ − mean Δ, so θ becomes the sample-weighted mean of the workers.
    cluster = _cluster(["method=localsgd", "workers=2", *SLOW_SECOND])
    assert cluster.samples_per_step() == {0: 6, 1: 2}  # 8 samples, split 3:1 by speed
    theta, workers = _theta_after_one_round(cluster)
    for i, t in enumerate(theta):
        expected = (6 * workers[0][i] + 2 * workers[1][i]) / 8
        torch.testing.assert_close(t, expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(theta[0], (workers[0][0] + workers[1][0]) / 2)


def test_equal_shares_keep_the_plain_mean():
    cluster = _cluster(["method=localsgd", "workers=2", *SLOW_SECOND, "batch.shares=equal"])
    assert cluster.samples_per_step() == {0: 4, 1: 4}
    theta, workers = _theta_after_one_round(cluster)
    torch.testing.assert_close(theta[0], (workers[0][0] + workers[1][0]) / 2, rtol=1e-5, atol=1e-7)


def test_the_time_controller_prices_a_balanced_trainer_at_its_common_step_time():
    cluster = _cluster(["method=adloco", "trainers=1", "workers=2", "batch.time.round_seconds=0.5", *SLOW_SECOND])
    (trainer,) = cluster.trainers.values()
    pace = cluster.batches.pace(trainer, None)
    assert pace is not None and pace.cost.per_sample == pytest.approx(2 / (1 / 0.01 + 1 / 0.03))
    equal = _cluster(["method=adloco", "trainers=1", "workers=2", "batch.time.round_seconds=0.5", *SLOW_SECOND[1:]])
    assert equal.batches.pace(next(iter(equal.trainers.values())), None).cost.per_sample == pytest.approx(0.03)


def test_keep_round_time_scales_h_by_the_samples_a_step_reads():
    cluster = _cluster(["method=diloco", "workers=2", "sync_every=12", "batch.time.keep_round_time=true"])
    (trainer,) = cluster.trainers.values()
    assert cluster.inner_steps_per_round() == 12  # batch.size=3 per worker: the start
    trainer.batch_size = 12
    assert cluster.inner_steps_per_round() == 3
    trainer.batch_size = 64
    assert cluster.inner_steps_per_round() == 1  # never below one step
    fixed = _cluster(["method=diloco", "workers=2", "sync_every=12"])
    next(iter(fixed.trainers.values())).batch_size = 12
    assert fixed.inner_steps_per_round() == 12


@pytest.mark.parametrize("method", ["diloco", "ddp", "adloco"])
def test_batched_workers_take_the_rounds_of_workers_one_by_one(method, monkeypatch):
    """The hosted workers run as one stacked group (statistics steps and all) and θ follows the one-by-one
    cluster within the worker group's tolerance (tests/workers/test_group.py)."""
    common = [f"method={method}", "workers=3", "sync_every=3", "inner.clip=0.05", *PINNED]
    batched, alone = _cluster([*common, "batched_workers=true"]), _cluster([*common, "batched_workers=false"])
    assert [g.worker_ids for g in batched.groups] == [[0, 1, 2]] and alone.groups == []
    seen = {"computed": 0, "statistics": 0, "stepped": 0}
    compute, step = WorkerGroup.compute_gradients, WorkerGroup.step

    def counted_compute(self, samples, b_max, stats_groups=None, gram=False):
        seen["computed"] += 1
        seen["statistics"] += stats_groups is not None
        return compute(self, samples, b_max, stats_groups, gram)

    def counted_step(self, lrs):
        stepped = step(self, lrs)
        seen["stepped"] += stepped
        return stepped

    monkeypatch.setattr(WorkerGroup, "compute_gradients", counted_compute)
    monkeypatch.setattr(WorkerGroup, "step", counted_step)
    for cluster in (batched, alone):
        for round_index in range(2):
            cluster.run_round(round_index, 3, lambda step: 2e-3)
    assert seen["computed"] == seen["stepped"] == 6  # every step of both rounds, stacked
    assert seen["statistics"] == (2 if method == "adloco" else 0)
    for mine, theirs in zip(batched.trainers[0].theta, alone.trainers[0].theta, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-7)
    start = _cluster(common).trainers[0].theta
    assert (
        max(float((mine - first).abs().max()) for mine, first in zip(batched.trainers[0].theta, start, strict=True)) > 0
    )


def _elastic(workers: int, elastic: bool = True) -> Cluster:
    return _cluster(["method=diloco", f"workers={workers}", f"elastic={str(elastic).lower()}"])


def test_an_elastic_resume_retires_the_highest_workers_and_brings_them_back_from_theta():
    four = _elastic(4)
    for worker in four.workers.values():  # every worker has read data and holds AdamW moments
        worker.compute_gradients(2, 2)
        worker.step(1e-3)
    saved = four.state_dict()

    three = _elastic(3)
    three.load_state_dict(saved)
    assert three.trainers[0].worker_ids == [0, 1, 2] and three.resized == (4, 3)
    assert torch.equal(three.retired_streams[3]["generator"], saved["workers"][3]["stream"]["generator"])
    assert torch.equal(three.workers[2].stream.state_dict()["generator"], saved["workers"][2]["stream"]["generator"])
    assert all(float(s["step"]) == 1 for s in three.workers[2].optimizer.state.values())  # a survivor keeps its own
    assert three.state_dict()["retired_streams"].keys() == {3}

    back = _elastic(4)
    back.load_state_dict(three.state_dict())
    returned = back.workers[3]
    assert back.trainers[0].worker_ids == [0, 1, 2, 3] and back.resized == (3, 4) and not back.retired_streams
    assert torch.equal(returned.stream.state_dict()["generator"], saved["workers"][3]["stream"]["generator"])
    # fresh inner state (a worker group binds it as zero moments at step 0), parameters at θ
    fresh = [s for s in returned.optimizer.state.values()]
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in fresh)
    assert all(torch.equal(p.detach(), t) for p, t in zip(returned.params, back.trainers[0].theta, strict=True))
    assert back.state_dict()["retired_streams"] == {}  # none retired now (the key is in every train state)


def test_a_checkpoint_of_another_worker_count_needs_elastic():
    saved = _elastic(4, elastic=False).state_dict()
    with pytest.raises(CheckpointError, match="elastic=true"):
        _elastic(3, elastic=False).load_state_dict(saved)


def test_a_sharded_worker_needs_a_process_per_shard():
    with pytest.raises(ConfigError, match="shards: a worker sharded over 2 ranks needs torchrun"):
        _cluster(["shards=2"])
