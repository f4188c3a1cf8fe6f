import json
import logging
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from adloco.checkpoint import (
    MANIFEST,
    TRAIN,
    CheckpointError,
    drop_checkpoints_after,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from adloco.config import build_config
from adloco.run.training import train
from benchmarks.reliability import kill_9_trial
from tests.conftest import FAST, final_params


def _save_rounds(directory, rounds, keep=3):
    for r in rounds:
        save_checkpoint(directory, r, {"value": torch.tensor([float(r)])}, keep=keep, kind=TRAIN)


def test_keeps_the_newest_and_records_checksums(tmp_path):
    _save_rounds(tmp_path, range(5))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000002.pt", "round_000003.pt", "round_000004.pt"]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["round"] for e in manifest["checkpoints"]] == [2, 3, 4]
    assert all(len(e["sha256"]) == 64 for e in manifest["checkpoints"])
    assert latest_checkpoint(tmp_path)["round"] == 4


def test_checkpoints_after_a_round_are_forgotten_manifest_and_files(tmp_path):
    """A run going on from round 2 trains rounds 3 and 4 again: their old checkpoints must not meet the new ones."""
    _save_rounds(tmp_path, range(5), keep=4)
    drop_checkpoints_after(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000001.pt", "round_000002.pt"]
    assert [e["round"] for e in json.loads((tmp_path / MANIFEST).read_text())["checkpoints"]] == [1, 2]
    assert latest_checkpoint(tmp_path)["round"] == 2
    drop_checkpoints_after(tmp_path, 2)  # nothing after it: nothing changes
    assert len(list_checkpoints(tmp_path)) == 2


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    _save_rounds(tmp_path, range(3))
    newest = list_checkpoints(tmp_path)[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: torch might still load it, the checksum will not
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        state = latest_checkpoint(tmp_path)
    assert state["round"] == 1
    assert "checksum mismatch" in caplog.text


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    _save_rounds(tmp_path, range(2))
    for path in list_checkpoints(tmp_path):
        path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="damaged"):
        latest_checkpoint(tmp_path)


def test_wrong_version_and_foreign_files(tmp_path):
    torch.save({"format_version": 99}, tmp_path / "round_000001.pt")
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(tmp_path / "round_000001.pt")
    torch.save([1, 2, 3], tmp_path / "round_000002.pt")
    with pytest.raises(CheckpointError, match="not an adloco checkpoint"):
        load_checkpoint(tmp_path / "round_000002.pt")
    (tmp_path / "round_000003.pt").write_text("hello")
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint"):
        load_checkpoint(tmp_path / "round_000003.pt")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    config = build_config(overrides=[*FAST, f"run.root={tmp_path}", "total_tokens=128", "run.name=a"])
    train(config)
    other = build_config(overrides=[*FAST, f"run.root={tmp_path}", "total_tokens=128", "model.preset=small"])
    with pytest.raises(CheckpointError, match="another model"):
        train(other, resume=tmp_path / "a")


@pytest.mark.process
def test_kill_9_at_random_moments_then_resume_is_bit_identical(tmp_path):
    """A real process killed with SIGKILL mid-run; --resume must end exactly where an uninterrupted run ends."""
    overrides = [*FAST, "total_tokens=6144", "checkpoint.every=1", "checkpoint.keep=2", "threads=1"]
    reference = train(build_config(overrides=[*overrides, f"run.root={tmp_path}", "run.name=reference"]))
    expected, rng = final_params(reference.run_dir), random.Random(0)
    delays = [rng.uniform(0.0, 1.5) for _ in range(2)]  # benchmarks/reliability.py runs twenty trials
    # The two trials run side by side: each is mostly a process importing torch, so this halves the wall time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        trials = pool.map(lambda t: kill_9_trial(tmp_path, overrides, f"killed{t}", delays[t], expected), range(2))
    for trial, result in enumerate(trials):
        assert result["killed"], "the run ended before it could be killed"
        assert result["resume_exit_code"] == 0, result["resume_stderr_tail"]
        assert result["bit_identical"], f"trial {trial}"
