"""The batch section's sub-sections, and the flat names their keys had in the previous release: still accepted
(YAML, overrides, a dict given to adloco.DiLoCo, a run directory's saved config) with one line naming the new key."""

import json
import warnings

import pytest
import torch
import yaml
from pydantic import BaseModel

from adloco import DiLoCo
from adloco.checkpoint import CheckpointError
from adloco.cli import main
from adloco.config import (
    RUN_CONFIG_FILE,
    BatchConfig,
    BatchTimeConfig,
    ConfigError,
    build_config,
    known_key,
    load_config,
    resume_changes,
    resume_config,
    setting_tier,
)
from adloco.config.batch import RENAMED, new_name
from adloco.config.input import layered
from adloco.errors import RenamedSettingWarning
from tests.conftest import FAST, PINNED_PACE, cut_back, final_params, same_params

# A value for each renamed key that differs from its default, so that landing in the right place shows.
SAMPLES = {
    "estimator": "cross_worker",
    "eta": 0.7,
    "theta": 0.6,
    "nu": 0.9,
    "ema": 0.3,
    "groups": 3,
    "test_every": 2,
    "patience": 3,
    "max_growth": 1.5,
    "min_steps_left": 7,
    "step_seconds": [0.01, 0.001],
    "round_seconds": 0.05,
    "keep_round_time": True,
    "lr_scaling": "linear",
    "lr_scale_max": 2.0,
    "beta2_scaling": False,
    "b_max": 8,
    "memory_fraction": 0.5,
    "memory_budget_mb": 100.0,
    "switch_factor": 1.5,
}
# The batch section exactly as the previous release wrote it into a run directory's config.yaml (method=adloco,
# batch.eta=0.7, batch.step_seconds=[0.01,0.001]).
PREVIOUS_BATCH_YAML = """\
size: 3
test: norm
controller: time
patience: 2
max_growth: 2.0
min_steps_left: 50
step_seconds:
- 0.01
- 0.001
keep_round_time: false
shares: equal
round_seconds: null
estimator: microbatch
eta: 0.7
theta: 0.8
nu: 1.0
ema: 0.5
groups: 4
b_min: 1
b_cap: 64
allow_shrink: false
test_every: 1
switch_factor: 2.0
lr_scaling: sqrt
lr_scale_max: 4.0
beta2_scaling: true
b_max: null
memory_fraction: 0.9
memory_budget_mb: null
"""
PREVIOUS_RELEASE = list(yaml.safe_load(PREVIOUS_BATCH_YAML))  # every key of the batch section then


def _note(old: str) -> str:
    return f"batch.{old} is now {new_name(f'batch.{old}')} (the old name works until the next release)"


def _value(config, dotted: str):
    """The setting ``dotted`` names in ``config``."""
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _override(value) -> str:
    return json.dumps(value)  # JSON is YAML, as an override's value is read


def _notes(record) -> list[str]:
    """The rename notes among the warnings ``record`` caught (torch may add its own)."""
    return [str(n.message) for n in record if n.category is RenamedSettingWarning]


def test_the_previous_flat_keys_are_the_batch_sections_own_keys_or_renamed_ones():
    sections = {name for name, field in BatchConfig.model_fields.items() if isinstance(field.annotation, type)
                and issubclass(field.annotation, BaseModel)}  # fmt: skip
    assert sections == {"statistics", "time", "scaling", "memory"}
    own = [name for name in BatchConfig.model_fields if name not in sections]
    assert sorted([*own, *RENAMED]) == sorted(PREVIOUS_RELEASE)  # none lost, none renamed twice
    assert set(SAMPLES) == set(RENAMED)
    for old in RENAMED:
        new = new_name(f"batch.{old}")
        assert new.count(".") == 2 and known_key(new) and not known_key(f"batch.{old}")
    assert new_name("batch.size") == "batch.size" and new_name("inner.eta") == "inner.eta"  # not renamed


def test_the_sub_sections_validate_their_keys_and_name_them_in_errors():
    config = build_config(
        overrides=[
            "method=adloco",
            "batch.statistics.eta=0.7",
            "batch.time.step_seconds=[0.01,0.001]",
            "batch.scaling.lr=linear",
            "batch.memory.b_max=8",
        ]
    )
    batch = config.batch
    assert (batch.statistics.eta, batch.time.step_seconds, batch.scaling.lr, batch.memory.b_max) == (
        0.7,
        (0.01, 0.001),
        "linear",
        8,
    )
    assert batch.statistics.ema == 0.5 and batch.time.patience == 2  # the rest keep their defaults
    assert setting_tier(type(batch.time), "patience") == "advanced" and setting_tier(BatchConfig, "size") == "basic"
    with pytest.raises(ConfigError) as error:
        build_config(overrides=["batch.statistics.eta=0"])
    assert str(error.value) == "batch.statistics.eta: Input should be greater than 0 (got 0)"
    with pytest.raises(ConfigError, match=r"^unknown key 'batch.time.eta'$"):
        build_config(overrides=["batch.time.eta=0.7"])
    with pytest.raises(ConfigError, match=r"^batch.time.step_seconds: give \[a, c\]"):
        build_config(overrides=["batch.time.step_seconds=[1,2,3]"])
    # a sub-section is a model of its own: the component that uses it can be built from it alone
    assert BatchTimeConfig(step_seconds=(0.1, 0.01)).step_seconds == (0.1, 0.01)


@pytest.mark.parametrize("old", list(RENAMED))
def test_an_old_flat_override_sets_its_new_key_with_one_note(old):
    new = new_name(f"batch.{old}")
    expected = build_config(overrides=[f"{new}={_override(SAMPLES[old])}"])
    assert _value(expected, new) != _value(build_config(), new)  # the sample is not the default
    with pytest.warns(RenamedSettingWarning) as notes:
        config = build_config(overrides=[f"batch.{old}={_override(SAMPLES[old])}"])
    assert config == expected
    assert _notes(notes) == [_note(old)]
    assert notes[0].filename == __file__  # the note points at the line that gave the old name


def test_old_names_in_a_yaml_file_each_get_one_note(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("method: adloco\nbatch:\n  size: 4\n  eta: 0.7\n  patience: 3\n  time:\n    max_growth: 1.5\n")
    with pytest.warns(RenamedSettingWarning) as notes:
        config = load_config(path)
    assert sorted(_notes(notes)) == sorted([_note("eta"), _note("patience")])
    assert config == build_config(
        overrides=[
            "method=adloco",
            "batch.size=4",
            "batch.statistics.eta=0.7",
            "batch.time.patience=3",
            "batch.time.max_growth=1.5",
        ]
    )


def test_a_bad_value_under_an_old_name_is_named_by_its_new_key():
    with pytest.warns(RenamedSettingWarning), pytest.raises(ConfigError) as error:
        build_config(overrides=["batch.eta=-1"])
    assert str(error.value) == "batch.statistics.eta: Input should be greater than 0 (got -1)"


@pytest.mark.parametrize(
    "given",
    [
        {"overrides": ["batch.eta=0.7", "batch.statistics.eta=0.7"]},  # the same value is no excuse
        {"data": {"batch": {"memory_fraction": 0.5, "memory": {"fraction": 0.6}}}},
    ],
)
def test_an_old_and_a_new_name_for_one_key_is_a_one_line_error(given):
    with pytest.raises(ConfigError) as error:
        build_config(given.get("data"), given.get("overrides"))
    old, new = ("eta", "statistics.eta") if "overrides" in given else ("memory_fraction", "memory.fraction")
    assert str(error.value) == (
        f"batch.{old} and batch.{new} are the same setting (batch.{old} is its old name); give batch.{new} only"
    )


def test_a_dict_given_to_diloco_takes_the_old_names_with_a_note():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RenamedSettingWarning) as notes:
        diloco = DiLoCo(model, optimizer, 2, "adloco", batch={"size": 2, "eta": 0.7, "b_max": 1})
    assert _notes(notes) == [_note("eta"), _note("b_max")]
    assert notes[0].filename == __file__  # the user's DiLoCo(...) line, not adloco's or pydantic's
    batch = diloco.settings.batch
    assert (batch.statistics.eta, batch.memory.b_max) == (0.7, 1)
    assert diloco.batch.plan.sizes == (1,)  # b_max=1 reached the object that plans micro-batches (switch mode)
    with pytest.raises(ConfigError, match="give batch.time.patience only"):
        DiLoCo(model, optimizer, 2, "adloco", batch={"patience": 2, "time": {"patience": 3}})


def _previous_release_yaml(config) -> str:
    """``config``'s config.yaml as the previous release wrote it: the batch section flat, under the old names."""
    data = yaml.safe_load(config.to_yaml())
    batch = data["batch"]
    for old, (sub, new) in RENAMED.items():
        batch[old] = batch[sub][new]
    data["batch"] = {
        key: value for key, value in batch.items() if key not in ("statistics", "time", "scaling", "memory")
    }
    return yaml.safe_dump(data, sort_keys=False)


def test_a_run_directory_of_the_previous_release_resumes_without_a_note(tmp_path):
    expected = build_config(
        overrides=["method=adloco", "batch.statistics.eta=0.7", "batch.time.step_seconds=[0.01,0.001]"]
    )
    (tmp_path / RUN_CONFIG_FILE).write_text(_previous_release_yaml(expected))
    # the helper writes what the previous release wrote (the end-to-end test below relies on it)
    assert yaml.safe_load(_previous_release_yaml(expected))["batch"] == yaml.safe_load(PREVIOUS_BATCH_YAML)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its user wrote none of these names: nothing to say to them
        assert resume_config(tmp_path) == expected
        assert resume_config(tmp_path, ["eval.every=5"]).eval.every == 5
    # an old name given on resume is refused under the key it is now
    with pytest.raises(ConfigError, match=r"^'batch.statistics.eta' cannot change when a run resumes"):
        resume_config(tmp_path, ["batch.eta=0.5"])


def test_a_checkpoint_of_the_previous_release_compares_equal_under_the_new_names():
    config = build_config(
        overrides=["method=adloco", "batch.statistics.eta=0.7", "batch.time.step_seconds=[0.01,0.001]"]
    )
    saved = {**config.model_dump(), "batch": yaml.safe_load(PREVIOUS_BATCH_YAML)}
    saved["batch"]["step_seconds"] = (0.01, 0.001)  # a checkpoint holds model_dump()'s tuple, not YAML's list
    assert resume_changes(saved, config) == []
    other = build_config(overrides=["method=adloco", "batch.time.step_seconds=[0.01,0.001]"])
    with pytest.raises(CheckpointError, match=r"batch.statistics.eta 0.7, now 0.8"):
        resume_changes(saved, other)


@pytest.mark.training  # a whole run, twice: out of the unit tier
def test_adloco_train_resumes_a_run_directory_the_previous_release_wrote(tmp_path, capsys):
    settings = [*PINNED_PACE, "method=adloco", "batch.statistics.eta=0.7", "total_tokens=768", "checkpoint.every=1"]
    args = ["train", *layered(FAST, settings, [f"run.root={tmp_path}", "run.name=full"])]
    assert main(args) == 0
    full = tmp_path / "full"
    partial = cut_back(full, tmp_path / "partial", keep=1)
    (partial / RUN_CONFIG_FILE).write_text(_previous_release_yaml(load_config(full / RUN_CONFIG_FILE)))
    capsys.readouterr()
    assert main(["train", "--resume", str(partial)]) == 0
    assert "batch." not in capsys.readouterr().err  # no note about names the user never wrote
    assert same_params(final_params(full), final_params(partial))  # the same run, to the bit


def test_the_cli_notes_an_old_name_on_one_line_and_prints_the_sub_sections(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "method=adloco", "batch.eta=0.7", "--print-config=all"]) == 0
    out, err = capsys.readouterr()
    assert err == f"adloco: {_note('eta')}\n"
    batch = yaml.safe_load(out)["batch"]
    assert {"statistics", "time", "scaling", "memory"} <= set(batch) and not set(RENAMED) & set(batch)
    assert batch["statistics"]["eta"] == 0.7 and batch["time"]["step_seconds"] is None
    assert main(["train", "--print-config"]) == 0
    assert "statistics" not in capsys.readouterr().out  # the basic tier shows none of the sub-sections' keys
    monkeypatch.setenv("RANK", "1")  # under torchrun rank 0 alone says it: every rank reads the same config
    assert main(["train", "batch.eta=0.7", "--print-config"]) == 0
    assert capsys.readouterr().err == ""


def test_the_cli_refuses_both_names_of_a_key_with_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "batch.step_seconds=[1,0]", "batch.time.step_seconds=[1,0]"]) == 2
    assert capsys.readouterr().err == (
        "adloco: error: batch.step_seconds and batch.time.step_seconds are the same setting (batch.step_seconds is "
        "its old name); give batch.time.step_seconds only\n"
    )
    assert not (tmp_path / "runs").exists()
