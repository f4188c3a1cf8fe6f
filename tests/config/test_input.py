"""Config input read safely: empty and repeated keys, duplicate YAML keys, alias bombs, tags, short excerpts."""

import resource

import pytest

from adloco.config import ConfigError, build_config, load_config
from adloco.config.input import (
    MAX_CONFIG_VALUES,
    YAMLInputError,
    apply_overrides,
    count_values,
    excerpt,
    layered,
    load_yaml,
    reject_repeated,
)


@pytest.mark.parametrize("item", ["workers=", "workers=  ", "inner.lr="])
def test_an_override_without_a_value_is_an_error_not_the_default(item):
    with pytest.raises(ConfigError, match=f"override '{item.split('=')[0]}=' has no value"):
        build_config(overrides=[item])


def test_a_key_typed_twice_with_different_values_names_both():
    with pytest.raises(ConfigError) as error:
        reject_repeated(["workers=2", "inner.lr=1e-3", "workers=3"])
    assert str(error.value) == "'workers' is given twice: 'workers=2' and 'workers=3'; give it once"
    reject_repeated(["workers=2", "workers=2", "inner.lr=1e-3", "inner.lr=0.001"])  # the same value: no contradiction


def test_a_program_lays_its_settings_over_defaults():
    assert build_config(overrides=["workers=2", "workers=3"]).workers == 3  # the Python API layers, in order
    assert layered(["workers=2", "inner.lr=1e-3"], ["workers=3"]) == ["inner.lr=1e-3", "workers=3"]


def test_null_still_resets_a_key_that_defaults_per_method():
    assert build_config(overrides=["method=adloco", "trainers=null"]).trainers == 1


def test_a_yaml_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("workers: 2\nbatch:\n  size: 3\n  size: 4\n")
    with pytest.raises(ConfigError, match=r"key 'size' is given twice \(lines 3 and 4\)"):
        load_config(path)
    # a merge key's values may be overridden: that is what merging is for
    assert load_yaml("base: &b {size: 3}\nbatch:\n  <<: *b\n  size: 4\n")["batch"] == {"size": 4}


def _bomb(levels: int, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join([*lines, f"data: {{separator: *a{levels - 1}}}"]) + "\n"


def test_an_alias_bomb_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(9))  # 9^10 ≈ 3.5 billion strings once expanded; a few hundred bytes on disk
    assert len(path.read_bytes()) < 600
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match="aliases expand to more than 100,000 values"):
        load_config(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: no expansion happened


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "batch: &b\n  size: 3\n  more: *b\n"])
def test_yaml_that_refers_to_itself_is_refused(text):
    with pytest.raises(YAMLInputError, match="refer to themselves"):
        load_yaml(text)


def test_an_alias_bomb_in_an_override_is_refused():
    levels = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 8)]
    with pytest.raises(ConfigError, match="aliases expand"):
        apply_overrides({}, ["data.separator={" + ", ".join(levels) + "}"])


def test_count_values_stops_just_past_its_limit():
    huge = [list(range(1000))] * 1000  # one list shared a thousand times: a million values
    assert count_values(huge, MAX_CONFIG_VALUES) == MAX_CONFIG_VALUES + 1
    assert count_values({"a": [1, 2], "b": {"c": 3}}, 100) == 9  # every key and value, the containers too


def test_error_lines_quote_a_short_excerpt_of_a_long_value():
    long_list = "[" + ",".join(["1"] * 5000) + "]"
    with pytest.raises(ConfigError) as error:
        build_config(overrides=[f"data.separator={long_list}"])
    assert len(str(error.value)) < 200 and "a list of more than 60 values" in str(error.value)
    with pytest.raises(ConfigError) as error:
        build_config(overrides=["workers=" + "9" * 5000])
    assert len(str(error.value)) < 200 and "too many digits" in str(error.value)
    assert excerpt("x" * 500).endswith("…") and len(excerpt("x" * 500)) == 60


def test_messages_speak_of_the_setting_not_of_pydantic_types():
    for value in ("5", "[[1,2],[3]]", "[1,2,3]"):
        with pytest.raises(ConfigError) as error:
            build_config(overrides=[f"batch.time.step_seconds={value}"])
        assert str(error.value) == "batch.time.step_seconds: give [a, c] or a list of [a, c] pairs, one per worker"
    with pytest.raises(ConfigError) as error:
        build_config(overrides=["batch.time.step_seconds=[1,x]"])
    assert str(error.value).startswith("batch.time.step_seconds.1: ") and "tuple[" not in str(error.value)


def test_a_python_tag_is_named_as_such(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("workers: 2\nmodel: !!python/object:os.system x\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "the tag '!!python/object:os.system' at line 2 is not allowed" in str(error.value)


def test_a_config_file_larger_than_a_config_can_be_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        load_config(path)


@pytest.mark.parametrize("name", ["..", ".", ""])
def test_a_run_name_of_dots_says_so(name):
    with pytest.raises(ConfigError, match=r"not empty, '\.' or '\.\.'"):
        build_config(overrides=[f"run.name='{name}'"])
