"""Checkpoints of format version 1, written by adloco before version 2 (tests/checkpoint/fixtures/v1, made by
make_fixtures.py), resume with today's code and end on the same bits as they did with the code that wrote them."""

from __future__ import annotations

import shutil

import pytest
import torch

from adloco.checkpoint import FORMAT_VERSION, REPLICA, TRAIN, latest_checkpoint
from adloco.cli import main
from tests.checkpoint.make_fixtures import FIXTURES, LOOPS, model_config_in_place, resume_loop


@pytest.mark.parametrize("name", ["train-file", "train-sharded"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_version_1_train_run_resumes_to_the_bits_it_ended_on(tmp_path, name):
    fixture = FIXTURES / name
    model_config_in_place(fixture)
    if name == "train-file":  # what the fixture is: version 1, which wrote no kind
        written = torch.load(fixture / "run" / "checkpoints" / "round_000001.pt", weights_only=True)
        assert written["format_version"] == 1 and "kind" not in written
    run_dir = shutil.copytree(fixture / "run", tmp_path / "run")
    assert main(["train", "--resume", str(run_dir)]) == 0
    reference = torch.load(fixture / "reference.pt", weights_only=True)
    ended = latest_checkpoint(run_dir / "checkpoints", kind=TRAIN)
    assert ended is not None and ended["round"] == reference["round"] > 1
    assert (ended["format_version"], ended["kind"]) == (FORMAT_VERSION, TRAIN)  # what the resume wrote
    assert {k: ended["counters"][k] for k in reference["counters"]} == reference["counters"]
    trainers = ended["cluster"]["trainers"]
    assert {int(k): int(t["batch_size"]) for k, t in trainers.items()} == reference["batch_size"]
    assert trainers.keys() == reference["theta"].keys()  # the two trainers merged after the resume, as before
    for k, theta in reference["theta"].items():
        assert all(torch.equal(a, b) for a, b in zip(trainers[k]["theta"], theta, strict=True))


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_version_1_loop_state_goes_on_to_the_bits_it_ended_on(name):
    fixture = torch.load(FIXTURES / f"{name}.pt", weights_only=True)
    theta, params = resume_loop(fixture, fixture["state"])
    assert all(torch.equal(a, b) for a, b in zip(theta, fixture["theta"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, fixture["params"], strict=True))


def test_a_version_1_replica_checkpoint_goes_on_to_the_bits_it_ended_on():
    fixture = torch.load(FIXTURES / "loop-int8-eager.pt", weights_only=True)
    saved = latest_checkpoint(FIXTURES / "replica", kind=REPLICA)
    assert saved is not None and saved["round"] == 2 and saved["kind"] == REPLICA
    theta, params = resume_loop(fixture, saved)
    assert all(torch.equal(a, b) for a, b in zip(theta, fixture["theta"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, fixture["params"], strict=True))
