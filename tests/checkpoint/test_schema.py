"""The one checkpoint format (``adloco.checkpoint.schema``): every kind written carries the version and its kind,
the migration table brings each version-1 shape up as its readers used to, and a newer version or the wrong kind
is refused with one line (exit code 2 from the command line)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from adloco.checkpoint import (
    FORMAT_VERSION,
    LOOP,
    MIGRATIONS,
    REPLICA,
    TRAIN,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    schema,
    upgraded,
)
from adloco.checkpoint.sharded import save_sharded_checkpoint
from adloco.cli import main
from tests.checkpoint.make_fixtures import FIXTURES, build_loop, model_config_in_place, resume_loop, run_loop

V1_TRAIN = FIXTURES / "train-file" / "run" / "checkpoints" / "round_000001.pt"


def test_the_migration_table_reaches_this_version_from_every_older_one():
    assert FORMAT_VERSION == 2
    assert sorted(MIGRATIONS) == list(range(1, FORMAT_VERSION))


def _payload(diloco) -> dict:
    """What a DiLoCo's state holds for this rank (the bytes of its one value, read back)."""
    (value,) = diloco.state_dict().values()
    return torch.load(io.BytesIO(value), weights_only=True)


def _as_state(payload: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return {"adloco_diloco_rank0": buffer.getvalue()}


def test_every_kind_written_carries_the_version_and_its_kind(tmp_path):
    model, optimizer, diloco = build_loop({"sync_every": 4})
    with diloco:
        run_loop(model, optimizer, diloco, torch.randn(64, 4), None, 0, 2)
    payload = _payload(diloco)
    assert (payload["format_version"], payload["kind"]) == (FORMAT_VERSION, LOOP)
    state = {"diloco": diloco.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    path = save_checkpoint(tmp_path / "replica", 1, state, keep=2, kind=REPLICA)
    written = torch.load(path, weights_only=True)
    assert (written["format_version"], written["kind"]) == (FORMAT_VERSION, REPLICA)
    part = {"cluster": {"trainers": {0: {}}, "workers": {}}}
    save_sharded_checkpoint(tmp_path / "sharded", 1, part, 2, 0, lambda: None, distributed=False)
    head = latest_checkpoint(tmp_path / "sharded")
    assert (head["format_version"], head["kind"]) == (FORMAT_VERSION, TRAIN)
    diloco.finish()


def test_a_version_1_train_state_is_brought_up_as_its_readers_used_to():
    """The oldest version-1 shape: no config, per-worker b_max only, no loss scale, error feedback or eager
    copy, exchanges in flight without their drift, a rule for H without ``settled``, a trainer without ``timed``."""
    drift_free = {"due": 3, "delta": [torch.ones(2)]}
    rule = {"sync_every": 8, "step_seconds": 0.5, "exchange_seconds": float("nan")}
    state = {
        "format_version": 1,
        "round": 2,
        "counters": {"round": 2, "tokens": 64, "step": 8, "bytes": 0},
        "cluster": {
            "trainers": {0: {"theta": [torch.zeros(2)], "worker_ids": [0, 1]}},
            "workers": {0: {"stream": {}, "b_max": 6}, 1: {"stream": {}, "b_max": 9}},
            "pending": {"0/0": drift_free},
            "sync_every": rule,
        },
    }
    up = upgraded(state, "a test's state")
    cluster = up["cluster"]
    assert (up["format_version"], up["kind"], up["config"]) == (2, TRAIN, None)
    assert cluster["b_max"] == {0: 6, 1: 9}
    assert cluster["workers"][1]["loss_scale"] == {"scale": 1.0, "good_steps": 0}
    assert all(cluster["workers"][w]["params"] is None for w in (0, 1))
    assert (cluster["workers"][0]["error_feedback"], cluster["workers"][0]["eager"]) == (None, None)
    assert cluster["pending"]["0/0"]["drift"] == {"worker_sq": {}, "mean_sq": 0.0}
    assert cluster["pending"]["0/0"]["dropped"] is False
    assert rule["settled"] is False  # an exchange time never measured: the rule had not decided on costs yet
    assert cluster["trainers"][0]["timed"] is None
    assert (cluster["costs"], cluster["retired_streams"]) == (None, {})
    assert upgraded(up, "a test's state") == up  # this version: nothing to do


def test_a_version_1_loop_state_is_brought_up_with_what_the_loading_diloco_knows():
    state = {"inner_step": 10, "world_size": 1, "batch": {"samples_done": 40, "worker_samples": 13}}
    known = {"settings": {"method": "diloco", "sync_every": 4}, "sync_every": 4, "worker_id": 2}
    up = upgraded(state, "a loop's state", known)
    assert (up["format_version"], up["kind"]) == (2, LOOP)
    assert up["settings"] == known["settings"]  # before settings were saved: taken as the loader's
    assert up["rounds"] == 2  # 10 steps of rounds of 4: two ended
    assert up["batch"]["samples_by_worker"] == {2: 13}
    assert (up["peak_lr"], up["replica"], up["sync_every"]) == (0.0, None, None)
    older = upgraded({"inner_step": 3, "world_size": 1, "settings": {"method": "diloco"}}, "a loop's state", known)
    assert older["settings"] == {"method": "diloco", "outer_optimizer": "sgd"}  # before the choice: SGD


def _resave(path: Path, state: dict) -> None:
    """``state`` in place of the checkpoint at ``path``, with no manifest (so no checksum) beside it."""
    torch.save(state, path)
    (path.parent / "manifest.json").unlink(missing_ok=True)


def test_a_version_1_train_checkpoint_of_an_older_adloco_resumes_to_the_same_bits(tmp_path):
    """The fixture with what older adloco did not write taken out (its config, the b_max table, loss scales, error
    feedback entries): the migration fills them as the resume used to, and the run ends on the same bits."""
    fixture = FIXTURES / "train-file"
    model_config_in_place(fixture)
    run_dir = shutil.copytree(fixture / "run", tmp_path / "run")
    state = torch.load(V1_TRAIN, weights_only=True)
    del state["config"], state["cluster"]["b_max"]
    for worker in state["cluster"]["workers"].values():
        del worker["loss_scale"], worker["error_feedback"]
    _resave(run_dir / "checkpoints" / V1_TRAIN.name, state)
    assert main(["train", "--resume", str(run_dir)]) == 0
    reference = torch.load(fixture / "reference.pt", weights_only=True)
    ended = latest_checkpoint(run_dir / "checkpoints", kind=TRAIN)
    assert (ended["format_version"], ended["kind"]) == (FORMAT_VERSION, TRAIN)
    for k, theta in reference["theta"].items():
        assert all(torch.equal(a, b) for a, b in zip(ended["cluster"]["trainers"][k]["theta"], theta, strict=True))


def test_a_version_1_loop_state_of_an_older_adloco_goes_on_to_the_same_bits():
    """The adaptive loop's fixture without what older adloco did not save (settings, round count, lr peak,
    replica step; one worker's sample count): the loading DiLoCo's own fill them."""
    fixture = torch.load(FIXTURES / "loop-adloco.pt", weights_only=True)
    payload = torch.load(io.BytesIO(fixture["state"]["diloco"]["adloco_diloco_rank0"]), weights_only=True)
    for key in ("settings", "rounds", "peak_lr", "replica", "sync_every"):
        del payload[key]
    payload["batch"]["worker_samples"] = payload["batch"].pop("samples_by_worker")[0]
    theta, params = resume_loop(fixture, {**fixture["state"], "diloco": _as_state(payload)})
    assert all(torch.equal(a, b) for a, b in zip(theta, fixture["theta"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, fixture["params"], strict=True))


def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adloco: error: ") and "\n" not in err, err
    return err


def test_a_newer_or_foreign_checkpoint_stops_a_resume_with_one_line(tmp_path, capsys):
    run_dir = shutil.copytree(FIXTURES / "train-file" / "run", tmp_path / "run")
    state = torch.load(V1_TRAIN, weights_only=True)
    _resave(run_dir / "checkpoints" / V1_TRAIN.name, {**state, "format_version": 3, "kind": TRAIN})
    err = _cli_error(["train", "--resume", str(run_dir)], capsys)
    assert "format version 3, newer than this adloco's 2" in err
    shutil.copy(FIXTURES / "replica" / "round_000002.pt", run_dir / "checkpoints" / V1_TRAIN.name)
    err = _cli_error(["train", "--resume", str(run_dir)], capsys)
    assert "is the checkpoint of a replica of adloco train, not an adloco train run's checkpoint" in err


def test_a_newer_version_or_another_kind_is_refused_by_every_reader(tmp_path, monkeypatch):
    state = upgraded(torch.load(V1_TRAIN, weights_only=True), "the fixture")
    with monkeypatch.context() as newer:  # written by an adloco of the next format version
        newer.setattr(schema, "FORMAT_VERSION", 3)
        save_sharded_checkpoint(tmp_path, 1, state, 2, 0, lambda: None, distributed=False)
    with pytest.raises(CheckpointError, match="format version 3, newer than this adloco's 2"):
        load_checkpoint(tmp_path / "round_000001")
    with pytest.raises(CheckpointError, match="is an adloco train run's checkpoint, not the checkpoint of a replica"):
        load_checkpoint(V1_TRAIN, kind=REPLICA)
    for wrong in ({"kind": "model"}, {"format_version": 2}, {"format_version": True}, {"format_version": "2"}):
        with pytest.raises(CheckpointError):
            upgraded({"round": 1, "format_version": 2, **wrong}, "a test's state")
    model, optimizer, diloco = build_loop({"sync_every": 4})
    payload = _payload(diloco)
    with pytest.raises(CheckpointError, match="DiLoCo state of rank 0 has format version 3, newer than"):
        diloco.load_state_dict(_as_state({**payload, "format_version": 3}))
    with pytest.raises(CheckpointError, match="is an adloco train run's checkpoint, not a loop's DiLoCo state"):
        diloco.load_state_dict(_as_state({**payload, "kind": TRAIN}))
