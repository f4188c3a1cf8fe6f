"""Sharded checkpoints (one file per rank, DCP): what goes in comes out, damage is caught, a torn save is ignored."""

import errno
import logging
import traceback

import pytest
import torch

from adloco.algorithms.sharding import ShardLayout
from adloco.checkpoint import (
    FORMAT_VERSION,
    TRAIN,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    recut_checkpoint,
    save_checkpoint,
)
from adloco.checkpoint.sharded import save_sharded_checkpoint
from adloco.errors import StorageError


def _shared(round_index: int) -> dict:
    """Rank 0's part: the awkward shapes a cluster's state has (integer keys, empty dicts, None, bytes of a
    generator, several dtypes, lists of tensors and of plain values)."""
    return {
        "format_version": FORMAT_VERSION,
        "kind": TRAIN,
        "round": round_index,
        "counters": {"round": round_index, "tokens": 64, "step": 2, "bytes": 0, "seconds": 1.5},
        "cluster": {
            "trainers": {0: {"theta": [torch.randn(3, 2), torch.arange(4)], "batch_size": 3, "worker_ids": [0, 1]}},
            "pending": {},
            "workers": {0: _worker(0)},
        },
    }


def _worker(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "params": None,
        "optimizer": {
            "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 2, generator=generator)}, 1: {}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1]}],
        },
        "stream": {"generator": generator.get_state()},
        "b_max": 8,
        "loss_scale": {"scale": 65536.0, "good_steps": 3},
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_what_was_written_comes_back_whole(tmp_path):
    """One rank here (several ranks' parts are merged under torchrun: tests/comm/test_distributed.py)."""
    expected = _shared(3)
    expected["cluster"]["workers"][1] = _worker(1)
    save_sharded_checkpoint(tmp_path, 3, expected, 2, 0, lambda: None, distributed=False)
    (folder,) = list_checkpoints(tmp_path)
    assert folder.is_dir() and folder.name == "round_000003"
    assert _same(latest_checkpoint(tmp_path), expected)


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _shared(1), keep=3, kind=TRAIN)  # the formats mix in one folder
    save_sharded_checkpoint(tmp_path, 2, _shared(2), 3, 0, lambda: None, distributed=False)
    shard = next((tmp_path / "round_000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path)["round"] == 1
    assert "fails its checksum" in caplog.text


def test_a_save_that_died_half_way_is_not_a_checkpoint_and_is_cleared_by_the_next(tmp_path):
    save_sharded_checkpoint(tmp_path, 1, _shared(1), 2, 0, lambda: None, distributed=False)
    torn = tmp_path / ".round_000002.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000001"]
    assert latest_checkpoint(tmp_path)["round"] == 1
    save_sharded_checkpoint(tmp_path, 2, _shared(2), 2, 0, lambda: None, distributed=False)
    assert not torn.exists() and latest_checkpoint(tmp_path)["round"] == 2


def test_only_the_newest_folders_are_kept(tmp_path):
    for r in range(4):
        save_sharded_checkpoint(tmp_path, r, _shared(r), 2, 0, lambda: None, distributed=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000002", "round_000003"]


def test_a_folder_without_rank_0s_part_is_refused(tmp_path):
    """Only another rank's part in the folder (as if rank 0's file were lost): no shared state to resume from."""
    tmp = tmp_path / ".round_000001.tmp"
    part = {"cluster": {"workers": {1: _worker(1)}}}
    save_sharded_checkpoint(tmp_path, 1, part, 2, 1, lambda: tmp.mkdir(parents=True), distributed=False)
    tmp.rename(tmp_path / "round_000001")  # what rank 0 would have done
    with pytest.raises(CheckpointError, match="no shared state"):
        latest_checkpoint(tmp_path)


def test_a_rank_reads_only_the_workers_it_asks_for(tmp_path):
    state = _shared(3)
    state["cluster"]["workers"][1] = _worker(1)
    save_sharded_checkpoint(tmp_path, 3, state, 2, 0, lambda: None, distributed=False)
    mine = latest_checkpoint(tmp_path, wanted=lambda w: w == 1)
    assert list(mine["cluster"]["workers"]) == [1] and _same(mine["cluster"]["workers"][1], _worker(1))
    assert _same(mine["cluster"]["trainers"], state["cluster"]["trainers"])  # the shared state comes whole


def test_a_full_disk_during_the_save_is_one_line(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    from adloco.checkpoint import sharded as checkpoint_sharded

    def no_space(*args, **kwargs):
        failure = OSError(errno.ENOSPC, "No space left on device")
        raise CheckpointException("save", {0: (failure, traceback.StackSummary())})

    monkeypatch.setattr(checkpoint_sharded.dcp, "save", no_space)
    with pytest.raises(StorageError, match="no space left on device while writing checkpoint"):
        save_sharded_checkpoint(tmp_path, 1, _shared(1), 2, 0, lambda: None, distributed=False)


def test_a_truncated_shard_that_no_checksum_covers_falls_back(tmp_path):
    save_sharded_checkpoint(tmp_path, 1, _shared(1), 3, 0, lambda: None, distributed=False)
    save_sharded_checkpoint(tmp_path, 2, _shared(2), 3, 0, lambda: None, distributed=False)
    (tmp_path / "manifest.json").unlink()  # no checksums left: the load itself must notice
    shard = next((tmp_path / "round_000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert latest_checkpoint(tmp_path)["round"] == 1


def test_leftovers_of_any_torn_save_are_cleared(tmp_path):
    (tmp_path / ".round_000007.tmp").mkdir(parents=True)
    save_sharded_checkpoint(tmp_path, 1, _shared(1), 2, 0, lambda: None, distributed=False)
    assert not list(tmp_path.glob(".round_*"))


def test_a_change_of_shard_count_cuts_theta_anew_and_restarts_error_feedback(tmp_path):
    """θ's rows are joined and cut again; a codec's flat residual per fragment has no parameter's rows to cut, so
    it restarts from zero (and says so) rather than failing on its shape at the first exchange."""
    theta = torch.randn(6, 2)

    def column(index: int) -> dict:
        rows = theta[3 * index : 3 * index + 3]
        worker = {"error_feedback": {"residuals": {"0/0": torch.randn(7)}}, "b_max": 4}
        return {"round": 2, "cluster": {"trainers": {0: {"theta": [rows]}}, "workers": {0: worker}}}

    layout = ShardLayout(0, 1, lambda: {(6, 2)})
    state = recut_checkpoint([column(0), column(1)], layout, tmp_path / "round_000002")
    assert torch.equal(state["cluster"]["trainers"][0]["theta"][0], theta)
    assert state["cluster"]["workers"][0]["error_feedback"] is None and state["cluster"]["workers"][0]["b_max"] == 4
    with pytest.raises(CheckpointError, match="written by 2 shards per worker, not 1"):
        recut_checkpoint([column(0), column(1)], ShardLayout(0, 1), tmp_path / "round_000002")
