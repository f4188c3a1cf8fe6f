"""The public Python API: `from adloco import train, TrainConfig`, as the README shows it."""

import pytest

import adloco
from adloco import TrainConfig, build_config, train
from tests.conftest import FAST


@pytest.mark.training
def test_a_config_built_in_python_trains_like_the_same_overrides(tmp_path):
    config = TrainConfig(
        model={"context": 16},
        workers=2,
        batch={"size": 2},
        sync_every=4,
        total_tokens=1024,
        inner={"warmup_steps": 2},
        eval={"every": 2, "blocks": 8, "final_full": False},
        run={"progress": False, "plots": False, "root": str(tmp_path), "name": "api"},
    )
    result = train(config)
    same = train(build_config(overrides=[*FAST, f"run.root={tmp_path}", "run.name=overrides"]))
    assert result.run_dir == tmp_path / "api" and (result.run_dir / "final").is_dir()
    assert result.val_loss == same.val_loss and result.tokens == same.tokens == 1024


def test_the_api_names_are_exported():
    assert {"train", "TrainConfig", "TrainResult", "build_config", "load_config"} <= set(adloco.__all__)
    assert all(getattr(adloco, name) is not None for name in adloco.__all__)
