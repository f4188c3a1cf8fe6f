"""A worker whose loss or gradient is NaN/inf is left out; a run that keeps failing stops cleanly."""

import collections
from pathlib import Path

import pytest
import torch

from adloco.checkpoint import latest_checkpoint
from adloco.config import build_config
from adloco.metrics.writer import read_metrics
from adloco.run.training import NonFiniteError, train
from adloco.workers.group import WorkerGroup
from adloco.workers.worker import Worker


def _poison(monkeypatch, should_fail):
    """Make chosen calls of a worker's gradient computation (one by one, or its slice of a stacked worker group)
    produce a NaN loss and NaN gradients."""
    original, original_group = Worker.compute_gradients, WorkerGroup.compute_gradients
    calls = collections.Counter()

    def spoil(worker, result):
        calls[worker.worker_id] += 1
        if should_fail(worker.worker_id, calls[worker.worker_id]):
            worker.params[0].grad.fill_(float("nan"))
            result.loss, result.finite = float("nan"), False

    def patched(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        spoil(self, result)
        return result

    def patched_group(self, *args, **kwargs):
        results = original_group(self, *args, **kwargs)
        for worker, result in zip(self.workers, results, strict=True):
            spoil(worker, result)
        return results

    monkeypatch.setattr(Worker, "compute_gradients", patched)
    monkeypatch.setattr(WorkerGroup, "compute_gradients", patched_group)


def _rounds(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


@pytest.mark.parametrize(
    ("method", "batched"), [("diloco", "true"), ("diloco", "false"), ("streaming", "true"), ("ddp", "true")]
)
def test_a_failing_worker_is_left_out_and_training_goes_on(method, batched, fast_overrides, monkeypatch):
    _poison(monkeypatch, lambda worker, call: worker == 1 and call == 6)  # round 1, second step
    result = train(build_config(overrides=[*fast_overrides, f"method={method}", f"batched_workers={batched}"]))
    rounds = _rounds(result.run_dir)
    assert rounds[1]["failed_workers"] == [1] and rounds[1]["skipped_trainers"] == []
    assert all(r["failed_workers"] == [] for i, r in enumerate(rounds) if i != 1)
    assert torch.isfinite(torch.tensor(result.val_loss))
    state = latest_checkpoint(result.run_dir / "checkpoints")
    assert all(torch.isfinite(t).all() for t in state["cluster"]["trainers"][0]["theta"])


def test_a_run_that_keeps_failing_stops_and_keeps_its_last_good_checkpoint(fast_overrides, monkeypatch):
    _poison(monkeypatch, lambda worker, call: call > 4)  # everything fails from round 1 on
    config = build_config(overrides=[*fast_overrides, "checkpoint.every=1", "total_tokens=4096"])
    with pytest.raises(NonFiniteError) as error:
        train(config)
    assert str(error.value) == (
        "training diverged: non-finite losses or gradients on every worker of a trainer for 3 rounds in a row "
        "(round 4); start a new run with a lower inner.lr (now 0.001) or outer.lr (now 1), or a longer "
        "inner.warmup_steps (now 2)"
    )
    run_dir = next(Path(config.run.root).iterdir())
    rounds = _rounds(run_dir)
    assert [r["skipped_trainers"] for r in rounds] == [[], [0], [0], [0]]
    state = latest_checkpoint(run_dir / "checkpoints")
    assert state["round"] == 1  # nothing was checkpointed after the failures began
    assert all(torch.isfinite(t).all() for t in state["cluster"]["trainers"][0]["theta"])
