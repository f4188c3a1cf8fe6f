"""Placement of workers on ranks, and the check before anything is built that the ranks can hold the job."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

from adloco.cli import main
from adloco.cluster.placement import check_world, hosted_workers, rank_placement
from adloco.config import ConfigError, WorldSpec, build_config
from adloco.config.input import layered
from tests.comm.test_distributed import _env, _torchrun_command
from tests.conftest import FAST


def _world(overrides: list[str]) -> WorldSpec:
    """What the ranks of the run with these overrides must hold, as ``adloco train`` reads it from its config."""
    return build_config(overrides=overrides).world


def test_rank_placement_gives_contiguous_blocks():
    assert rank_placement(4, 2, None) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert rank_placement(4, 1, None) == {w: 0 for w in range(4)}
    config = build_config(overrides=["workers=2", "shards=2"])
    placed = {"total_workers": config.total_workers, "slots_per_rank": config.slots_per_rank, "shards": config.shards}
    assert [hosted_workers(rank, 4, **placed) for rank in range(4)] == [{0}, {0}, {1}, {1}]


@pytest.mark.parametrize(
    ("workers", "world", "slots", "fragment"),
    [
        (1, 2, None, "1 worker(s) do not fill 2 rank(s) with the same number each"),
        (3, 2, None, "3 worker(s) do not fill 2 rank(s)"),
        (4, 2, 3, "with 3 slots each"),
    ],
)
def test_workers_that_do_not_fill_the_ranks_are_refused(workers, world, slots, fragment):
    overrides = [f"workers={workers}"] + ([f"slots_per_rank={slots}"] if slots else [])
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_world(_world(overrides), world, torchrun=True)


@pytest.mark.parametrize(
    ("overrides", "world", "torchrun", "fragment"),
    [
        (["shards=2"], 1, False, "shards=2: a worker sharded over 2 ranks needs torchrun"),
        (["workers=1", "shards=3"], 2, True, "shards=3: torchrun started 2 rank(s)"),
        (["workers=1", "shards=3"], 4, True, "multiple of 3"),
        (["workers=3", "shards=2"], 4, True, "3 worker(s) do not fill 2 rank(s)"),
    ],
)
def test_shard_arithmetic_is_checked_before_anything_is_built(overrides, world, torchrun, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_world(_world(overrides), world, torchrun)


def test_a_job_that_fits_passes():
    check_world(_world(["workers=2", "shards=2"]), 4, torchrun=True)
    check_world(_world(["elastic=true", "workers=4"]), 3, torchrun=True)  # the ranks decide
    check_world(_world(["comm.backend=nccl"]), 1, torchrun=False)  # one process has no backend


def test_nccl_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="with device=cpu use comm.backend=gloo"):
        check_world(_world(["comm.backend=nccl", "device=cpu"]), 4, torchrun=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="nccl needs CUDA GPUs and this machine has none"):
        check_world(_world(["comm.backend=nccl"]), 4, torchrun=True)


def test_sharded_workers_in_one_process_are_one_line_before_a_run_directory(tmp_path, capsys):
    code = main(["train", *FAST, "shards=2", f"run.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs torchrun" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.process
def test_a_torchrun_job_the_ranks_cannot_hold_stops_with_one_line_per_rank(tmp_path):
    """Each rank that speaks says it, once, and exits 2 before a run directory is made (one refusal under torchrun
    stands for them all: check_world's others are checked in process above). The check runs before torch is
    imported, in a fraction of a second: torchrun stops the other ranks as soon as the first exits, so whether a
    second rank gets to print its line is a race."""
    ranks, overrides = 2, ["elastic=true", "workers=4"]
    line = "adloco: error: workers=4: an elastic job has one worker per rank slot"
    command = _torchrun_command(ranks, layered(FAST, overrides, [f"run.root={tmp_path / 'runs'}"]))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=_env())
    assert result.returncode != 0
    ours = [text for text in result.stderr.splitlines() if text.startswith("adloco:")]
    assert 1 <= len(ours) <= ranks and all(text.startswith(line) for text in ours), result.stderr[-2000:]
    assert "ZeroDivisionError" not in result.stderr and "lost contact" not in result.stderr
    assert "exitcode: 2" in result.stderr  # a config error, not a crash
    assert not Path(tmp_path / "runs").exists()  # refused before a run directory was made


def test_an_elastic_job_says_how_many_workers_its_ranks_give(monkeypatch):
    from adloco.cluster import placement
    from adloco.comm import distributed

    monkeypatch.setattr(distributed, "launched_by_torchrun", lambda: True)
    default = build_config(overrides=["elastic=true"])  # workers left to its default, 4

    def size(config, fresh):  # on 2 ranks, as adloco train asks
        given = "workers" in config.given_keys
        return placement.elastic_size(
            config.workers, 2, fresh, elastic=config.elastic, slots_per_rank=config.slots_per_rank, given=given
        )

    workers, note = size(default, fresh=True)
    assert workers == 2 and note == "elastic: this job has 2 ranks × 1 worker slot(s) = 2 workers, not workers=4"
    assert size(default, fresh=False) == (2, None)  # a resume says "workers: 4 -> 2"
    with pytest.raises(ConfigError, match="workers=4: an elastic job has one worker per rank slot"):
        size(build_config(overrides=["elastic=true", "workers=4"]), fresh=True)
