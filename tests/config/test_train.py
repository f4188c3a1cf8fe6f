import pytest

from adloco.checkpoint import CheckpointError
from adloco.config import (
    RUN_CONFIG_FILE,
    ConfigError,
    basic_settings,
    build_config,
    count_settings,
    known_key,
    load_config,
    resume_changes,
    resume_config,
    setting_tier,
)


def test_defaults_resolve_per_method():
    diloco = build_config()
    assert (diloco.method, diloco.workers, diloco.trainers, diloco.sync_every) == ("diloco", 4, 1, 10)
    assert (diloco.outer.lr, diloco.outer.momentum, diloco.outer.nesterov) == (1.0, 0.5, True)
    ddp = build_config({"method": "ddp"})
    assert ddp.outer.lr == 1.0 and ddp.outer.momentum == 0.0
    local = build_config(overrides=["method=localsgd"])
    assert local.outer.lr == 1.0 and local.outer.nesterov is False
    adloco = build_config(overrides=["method=adloco"])
    assert (adloco.trainers, adloco.workers, adloco.batch.test, adloco.batch.controller) == (1, 4, "norm", "time")
    assert adloco.batch.statistics.ema == 0.5 and adloco.merge.policy == "off"  # nothing to merge with one trainer
    instances = build_config(overrides=["method=adloco", "trainers=4", "workers=1"])
    assert instances.merge.policy == "b_req" and instances.merge.shared_init


def test_overrides_parse_yaml_values_and_nested_keys():
    config = build_config(overrides=["inner.lr=2e-3", "batch.size=5", "outer.nesterov=false", "inner.clip=null"])
    assert config.inner.lr == 2e-3 and config.batch.size == 5
    assert config.outer.nesterov is False and config.inner.clip is None


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["workerz=3"], "unknown key 'workerz'"),
        (["inner.lrr=1"], "unknown key 'inner.lrr'"),
        (["workers=0"], "workers"),
        (["workers=four"], "workers"),
        (["method=sgd"], "method"),
        (["inner.lr=-1"], "inner.lr"),
        (["noequals"], "key=value"),
        (["=3"], "empty key"),
        (["inner=3"], "inner"),
        (["inner.lr.x=3"], "inner.lr"),
        (["method=localsgd", "outer.lr=0.5"], "outer.lr"),
        (["batch.b_min=10", "batch.b_cap=5"], "b_min"),
        (["method=ddp", "batch.shares=speed"], "batch.shares"),
        (["workers=2", "batch.time.step_seconds=[[0,0.1]]"], "1 pairs for 2 workers"),
        (["batch.time.step_seconds=[]"], "batch.time.step_seconds"),
        (["batch.time.step_seconds=[0,-1]"], "batch.time.step_seconds"),
        (["method=streaming", "batch.time.keep_round_time=true"], "batch.time.keep_round_time"),
        (["elastic=true", "method=adloco", "trainers=2"], "elastic: resizes one trainer"),
        (["elastic=true", "data.streaming=true"], "elastic: a streamed corpus"),
        (
            ["elastic=true", "workers=2", "batch.time.step_seconds=[[0,0.1],[0,0.2]]"],
            "elastic: batch.time.step_seconds",
        ),
        (["elastic=true", "outer.overlap=eager"], "elastic: outer.overlap=eager"),
        (["shards=0"], "shards"),
        (["shards=2", "elastic=true"], "elastic: resizing a job of sharded workers"),
        (["shards=2", "checkpoint.format=file"], "checkpoint.format: sharded workers"),
    ],
)
def test_bad_values_give_one_line_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        build_config(overrides=overrides)
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message


def test_yaml_file_and_errors(tmp_path):
    good = tmp_path / "run.yaml"
    good.write_text("method: adloco\nworkers: 2\ninner:\n  lr: 0.002\n")
    config = load_config(good, ["workers=3"])
    assert config.method == "adloco" and config.workers == 3 and config.inner.lr == 0.002
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listing)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips_through_yaml(tmp_path):
    for overrides in (
        ["method=adloco", "batch.statistics.eta=0.5"],
        ["workers=2", "batch.time.step_seconds=[[0,0.1],[0.01,0.2]]"],
    ):
        config = build_config(overrides=overrides)
        path = tmp_path / "config.yaml"
        path.write_text(config.to_yaml())
        assert load_config(path) == config


def test_yaml_words_like_off_stay_strings(tmp_path):
    assert build_config(overrides=["merge.policy=off"]).merge.policy == "off"
    path = tmp_path / "c.yaml"
    path.write_text("method: adloco\nmerge:\n  policy: off\nbatch:\n  allow_shrink: true\n")
    config = load_config(path)
    assert config.merge.policy == "off" and config.batch.allow_shrink is True


@pytest.mark.parametrize("override", ["=\n}", "bogus\nkey=1", "seed=\r\n"])
def test_errors_quoting_line_breaks_stay_on_one_line(override):
    with pytest.raises(ConfigError) as caught:
        build_config(overrides=[override])
    assert "\n" not in str(caught.value) and "\r" not in str(caught.value)


def test_local_paths_are_stored_absolute_and_names_stay_as_given(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("x")
    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    config = build_config(
        overrides=["data.dataset=corpus.txt", "data.tokenizer=tok", "data.hf_name=missing", "data.hf_data_files=hf:tok"]
    )
    assert config.data.dataset == str(tmp_path / "corpus.txt") and config.data.tokenizer == str(tmp_path / "tok")
    assert config.data.hf_name == "missing" and config.data.hf_data_files == f"hf:{tmp_path / 'tok'}"
    (tmp_path / "byte").mkdir()  # a folder named like a keyword does not shadow the keyword
    assert build_config(overrides=["data.tokenizer=byte"]).data.tokenizer == "byte"
    assert build_config().data.dataset == "tinyshakespeare"


@pytest.mark.parametrize("elastic", [False, True])
def test_the_worker_count_may_change_on_resume_only_in_an_elastic_run(elastic, tmp_path):
    (tmp_path / RUN_CONFIG_FILE).write_text(build_config(overrides=[f"elastic={str(elastic).lower()}"]).to_yaml())
    if elastic:
        assert resume_config(tmp_path, ["workers=3"]).workers == 3
    else:
        with pytest.raises(ConfigError, match="'workers' cannot change"):
            resume_config(tmp_path, ["workers=3"])


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default():
    config = build_config(overrides=["method=adloco"])
    older = config.model_dump()
    del older["elastic"], older["checkpoint"]["format"]  # settings this checkpoint's adloco did not have yet
    assert resume_changes(older, config) == []
    with pytest.raises(CheckpointError, match="elastic False, now True"):
        resume_changes(older, build_config(overrides=["method=adloco", "elastic=true"]))


def test_sharded_workers_write_sharded_checkpoints_unless_told_otherwise():
    assert build_config(overrides=["shards=2"]).checkpoint.format == "sharded"
    assert build_config().checkpoint.format == "file"


def test_a_config_path_that_cannot_be_opened_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read: embedded null byte"):
        load_config("a\x00b.yaml")  # found by the command-line fuzzer: a ValueError, not an OSError
    undecodable = tmp_path / "latin1.yaml"
    undecodable.write_bytes(b"seed: 1 # caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(undecodable)


def test_outer_adam_takes_its_own_lr_default_and_refuses_sgd_settings():
    adam = build_config(overrides=["outer.optimizer=adam", "outer.betas=[0.8, 0.9]"])
    assert (adam.outer.lr, adam.outer.momentum, adam.outer.nesterov, adam.outer.betas) == (3e-3, 0.0, False, (0.8, 0.9))
    assert build_config(overrides=["outer.lr=2.5"]).outer.lr == 2.5  # an outer lr above 1 is a setting, not a typo
    with pytest.raises(ConfigError, match="outer.momentum: applies to outer.optimizer=sgd"):
        build_config(overrides=["outer.optimizer=adam", "outer.momentum=0.9"])
    with pytest.raises(ConfigError, match="outer.optimizer: localsgd fixes it to sgd"):
        build_config(overrides=["method=localsgd", "outer.optimizer=adam"])
    with pytest.raises(ConfigError, match="outer.betas"):
        build_config(overrides=["outer.optimizer=adam", "outer.betas=[0.9, 1.0]"])


def test_a_feedback_decay_without_error_feedback_is_refused():
    assert build_config(overrides=["codec.name=topk", "codec.feedback_decay=0.9"]).codec.error_feedback is True
    with pytest.raises(ConfigError, match="feedback_decay"):
        build_config(overrides=["codec.name=int8", "codec.feedback_decay=0.9"])


def test_settings_come_in_two_tiers_and_the_basic_one_is_short():
    basic, total = count_settings()
    assert 20 <= basic <= 30 and total > 4 * basic  # a short list a new user reads; the rest stays reachable
    config = build_config(overrides=["method=adloco", "batch.statistics.eta=0.5"])
    shown = basic_settings(config)
    assert shown["method"] == "adloco" and shown["batch"] == {"size": 3}  # batch.statistics.eta is an AdLoCo internal
    assert shown["outer"] == {"lr": 1.0, "momentum": 0.5}  # resolved per method, not null
    assert "comm" not in shown and "sync_auto" not in shown  # a section with no basic setting is left out
    flat = [
        f"{s}.{k}" if isinstance(v, dict) else s for s, v in shown.items() for k in (v if isinstance(v, dict) else [s])
    ]
    assert len(flat) == basic and all(known_key(key) for key in flat)
    assert (
        setting_tier(type(config.batch.statistics), "eta") == "advanced"
        and setting_tier(type(config), "method") == "basic"
    )
