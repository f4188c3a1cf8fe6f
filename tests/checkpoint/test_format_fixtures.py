"""Checkpoints of format version 1, written by adloco before version 2 (tests/checkpoint/fixtures/v1, made by
make_fixtures.py), resume with today's code and end on the same bits as they did with the code that wrote them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from adloco.checkpoint import latest_checkpoint
from adloco.cli import main
from tests.checkpoint.make_fixtures import FIXTURES, LOOPS, MODEL_DIR, build_loop, run_loop


def _model_config_in_place(fixture: Path) -> None:
    """The run's model config at the absolute path its checkpoint names (written atomically: test runs may meet)."""
    wanted = (fixture / "micro-llama.json").read_bytes()
    target = MODEL_DIR / "config.json"
    if target.exists() and target.read_bytes() == wanted:
        return
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    partial = MODEL_DIR / f".config.json.{os.getpid()}"
    partial.write_bytes(wanted)
    os.replace(partial, target)


@pytest.mark.parametrize("name", ["train-file", "train-sharded"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_version_1_train_run_resumes_to_the_bits_it_ended_on(tmp_path, name):
    fixture = FIXTURES / name
    _model_config_in_place(fixture)
    written = (
        torch.load(fixture / "run" / "checkpoints" / "round_000001.pt", weights_only=True)
        if name == "train-file"
        else None
    )
    assert written is None or written["format_version"] == 1  # what the fixture is
    run_dir = shutil.copytree(fixture / "run", tmp_path / "run")
    assert main(["train", "--resume", str(run_dir)]) == 0
    reference = torch.load(fixture / "reference.pt", weights_only=True)
    ended = latest_checkpoint(run_dir / "checkpoints")
    assert ended is not None and ended["round"] == reference["round"] > 1
    assert {k: ended["counters"][k] for k in reference["counters"]} == reference["counters"]
    trainers = ended["cluster"]["trainers"]
    assert {int(k): int(t["batch_size"]) for k, t in trainers.items()} == reference["batch_size"]
    assert trainers.keys() == reference["theta"].keys()  # the two trainers merged after the resume, as before
    for k, theta in reference["theta"].items():
        assert all(torch.equal(a, b) for a, b in zip(trainers[k]["theta"], theta, strict=True))


def _resume_loop(fixture: dict, state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fixture's loop built afresh, ``state`` (its saved model, inner optimizer, DiLoCo) loaded, the remaining
    steps run: its θ and model parameters."""
    model, optimizer, diloco = build_loop(fixture["settings"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    diloco.load_state_dict(state["diloco"])
    batches = None
    if "sampler" in fixture["state"]:
        sampler = diloco.batch.sampler(len(fixture["data"]), seed=1)
        sampler.load_state_dict(fixture["state"]["sampler"])
        batches = iter(sampler)
    before, after = fixture["steps"]
    assert diloco.inner_step == before and diloco.round_step != 0  # saved mid-round
    with diloco:
        run_loop(model, optimizer, diloco, fixture["data"], batches, before, after)
    diloco.flush()
    ended = [t.clone() for t in diloco.theta], [p.detach().clone() for p in model.parameters()]
    diloco.finish()  # a loop's proper end (a DiLoCo left unfinished warns), after the numbers compared are taken
    return ended


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_version_1_loop_state_goes_on_to_the_bits_it_ended_on(name):
    fixture = torch.load(FIXTURES / f"{name}.pt", weights_only=True)
    theta, params = _resume_loop(fixture, fixture["state"])
    assert all(torch.equal(a, b) for a, b in zip(theta, fixture["theta"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, fixture["params"], strict=True))


def test_a_version_1_replica_checkpoint_goes_on_to_the_bits_it_ended_on():
    fixture = torch.load(FIXTURES / "loop-int8-eager.pt", weights_only=True)
    saved = latest_checkpoint(FIXTURES / "replica")
    assert saved is not None and saved["round"] == 2
    theta, params = _resume_loop(fixture, saved)
    assert all(torch.equal(a, b) for a, b in zip(theta, fixture["theta"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, fixture["params"], strict=True))
