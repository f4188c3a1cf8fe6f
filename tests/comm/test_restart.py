"""Automatic resume when torchrun restarts a job (``--max-restarts``): one run directory, the same final bits."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adloco.checkpoint import list_checkpoints
from adloco.cluster.placement import resolve_device
from adloco.comm.distributed import job_key
from adloco.comm.local import LocalCommunicator
from adloco.config import ConfigError, build_config
from adloco.metrics.writer import read_metrics
from adloco.run.directory import JOBS_DIR, restart_plan
from adloco.run.training import run_identity, train
from tests.comm.crash_launch import CRASH_AFTER_STEP, CRASH_RANK
from tests.conftest import final_params, same_params

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

# 2 workers x batch 2 x context 16 = 64 tokens a step, 2 steps a round: 6 rounds, a checkpoint after each.
RUN = [
    "model.context=16",
    "method=diloco",
    "workers=2",
    "batch.size=2",
    "sync_every=2",
    "total_tokens=768",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "checkpoint.every=1",
    "run.progress=false",
    "run.plots=false",
    "threads=1",  # the same kernels in every process, so bits can be compared
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != JOBS_DIR)


def _rounds(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, never interrupted, in one process."""
    root = tmp_path_factory.mktemp("reference")
    return train(build_config(overrides=[*RUN, f"run.root={root}"])).run_dir


@pytest.mark.process
def test_torchrun_restart_resumes_the_run_by_itself(tmp_path, reference):
    """Rank 0 is SIGKILLed mid-round 4 (after step 7 of 2-step rounds); torchrun restarts both ranks, which
    resume from round 3's checkpoint."""
    root = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    repo = str(Path(__file__).resolve().parents[2])
    env.update({"PYTHONWARNINGS": "ignore", CRASH_AFTER_STEP: "7", CRASH_RANK: "0"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "tests.comm.crash_launch",
        "train",
        *RUN,
        f"run.root={root}",
        "comm.timeout_s=20",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    (run_dir,) = _run_dirs(root)  # the restart found the first attempt's directory, made no second one
    assert f"restart 1 of 1: resuming {run_dir.resolve()} from the checkpoint of round 3" in result.stderr
    assert "Traceback" not in result.stdout
    # the survivor saw a failed collective, not zeros it could take for non-finite workers
    assert "non-finite" not in result.stderr and "skipped" not in result.stderr
    assert same_params(final_params(reference), final_params(run_dir))
    log = (run_dir / "train.log").read_text()
    assert log.count("start: method=diloco") == 1 and "restart 1 of 1: resuming" in log
    # metrics.jsonl was cut back to the checkpoint: every round and step exactly once, the same losses.
    rounds = _rounds(run_dir)
    assert [r["round"] for r in rounds] == list(range(1, 7))
    assert [r["train_loss"] for r in rounds] == [r["train_loss"] for r in _rounds(reference)]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(1, 13))


@pytest.fixture
def torchrun_env(monkeypatch):
    """The variables torchrun gives a worker of a job with ``--max-restarts=2``, first attempt."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return monkeypatch


def _train_attempt(overrides: list[str]):
    # In-process stand-in for one rank: the directory logic is the same, no process group needed.
    return train(build_config(overrides=overrides), comm=LocalCommunicator())


@pytest.mark.training
def test_restart_without_a_checkpoint_starts_over_in_the_same_directory(tmp_path, reference, torchrun_env):
    overrides = [*RUN, f"run.root={tmp_path}"]
    first = _train_attempt(overrides).run_dir
    pointer = tmp_path / JOBS_DIR / "job_42"
    assert Path(pointer.read_text().strip()) == first.resolve()
    # As if the first attempt had died before its first checkpoint, leaving records of rounds never saved.
    shutil.rmtree(first / "final")
    for path in list_checkpoints(first / "checkpoints"):
        path.unlink()
    (first / "checkpoints" / "manifest.json").unlink()
    with open(first / "metrics.jsonl", "a") as handle:
        handle.write('{"kind": "round", "round": 99}\n')

    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = _train_attempt(overrides).run_dir
    assert again.resolve() == first.resolve() and _run_dirs(tmp_path) == [first]
    assert [r["round"] for r in _rounds(first)] == list(range(1, 7))
    assert same_params(final_params(reference), final_params(first))
    assert "restart 1 of 2: the previous attempt left no checkpoint; starting" in (first / "train.log").read_text()


@pytest.mark.training
def test_restart_resumes_from_the_newest_checkpoint(tmp_path, reference, torchrun_env):
    overrides = [*RUN, f"run.root={tmp_path}", "checkpoint.keep=10"]
    first = _train_attempt(overrides).run_dir
    shutil.rmtree(first / "final")
    for path in list_checkpoints(first / "checkpoints")[2:]:  # the first attempt died in round 2
        path.unlink()

    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = _train_attempt(overrides).run_dir
    assert again.resolve() == first.resolve() and _run_dirs(tmp_path) == [first]
    assert "restart 1 of 2: resuming" in (first / "train.log").read_text()
    assert "from the checkpoint of round 2" in (first / "train.log").read_text()
    assert [r["round"] for r in _rounds(first)] == list(range(1, 7))
    assert same_params(final_params(reference), final_params(first))


def test_restart_refuses_a_directory_of_another_configuration(tmp_path, torchrun_env):
    first = _train_attempt([*RUN, f"run.root={tmp_path}", "total_tokens=256"]).run_dir
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="started with another configuration"):
        _train_attempt([*RUN, f"run.root={tmp_path}", "total_tokens=512"])
    assert _run_dirs(tmp_path) == [first]


def test_restart_after_a_first_attempt_that_made_no_directory_starts_fresh(tmp_path, torchrun_env):
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = _train_attempt([*RUN, f"run.root={tmp_path}", "total_tokens=256"])
    assert _run_dirs(tmp_path) == [result.run_dir]
    assert "the previous attempt left no run directory" in (result.run_dir / "train.log").read_text()


def test_job_key_is_stable_and_safe(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_key() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "../a b")
    assert job_key() == "___a_b"
    # torchrun's default id is "none" for every job: the job's fixed master address and port tell them apart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_key() == "none_127_0_0_1_29500"


@pytest.mark.parametrize("elastic", [True, False])
def test_a_restart_with_another_world_size_resumes_only_an_elastic_job(tmp_path, torchrun_env, elastic):
    """What rank 0 of a restarted attempt decides when torchrun (--nnodes=MIN:MAX) came back with fewer ranks."""
    job = [*RUN, f"run.root={tmp_path}", f"elastic={str(elastic).lower()}", "slots_per_rank=2"]
    first = _train_attempt(job).run_dir  # one rank of two slots: 2 workers
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    smaller = build_config(overrides=[*job, "workers=1"])  # a restart that came back with half the worker slots
    # train resolves precision=auto for its device before it asks
    _, smaller.precision = resolve_device(smaller.device, smaller.precision, smaller.tf32)
    if elastic:
        assert restart_plan(run_identity(smaller)) == ("resume", str(first.resolve()))
    else:
        with pytest.raises(ConfigError, match="started with another configuration"):
            restart_plan(run_identity(smaller))
