"""Property-based fuzzing of everything a user hands adloco: config dicts and overrides, YAML files, command
lines, data files and checkpoints. Each input ends either valid or as one line naming the problem (exit code 2
through the CLI), never as a traceback. Inputs that would start real training are kept out."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from adloco.checkpoint import MANIFEST, list_checkpoints
from adloco.cli import main
from adloco.cluster.placement import check_world, hosted_workers
from adloco.config import ConfigError, TrainConfig, build_config, load_config
from adloco.config.input import reject_repeated
from adloco.data import ByteTokenizer, Corpus, DataError
from adloco.run.training import train
from tests.conftest import FAST

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
CONTEXT = 16


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _dotted_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


KEYS = _dotted_keys(TrainConfig)
SECTIONS = sorted({key.split(".")[0] for key in KEYS if "." in key})
# Values that broke parsers elsewhere: YAML specials, NaN/inf spellings, huge numbers, control and odd unicode.
NASTY = [
    "",
    " ",
    "nan",
    ".nan",
    "NaN",
    "inf",
    ".inf",
    "-.inf",
    "1e999",
    "-1e999",
    "-1",
    "0",
    "1",
    "2",
    "1.5",
    "-0.0",
    "99999999999999999999999999",
    "0x10",
    "1_000",
    "null",
    "~",
    "true",
    "no",
    "off",
    "[1, 2]",
    "{a: 1}",
    "[",
    "{",
    "]",
    "'",
    '"',
    "&a [*a]",
    "*a",
    "!!binary aGk=",
    "!!python/object/apply:os.system ['true']",
    "!!float x",
    "2001-12-14",
    "é",
    "日本",
    "\u202e",
    "\ud800",
    "\udcff",
    "\x00",
    "a\nb",
    "\r",
    "\t",
    "=",
    "a=b",
    "..",
    "/",
    "/proc/self/mem",
    "tinyshakespeare",
    "diloco",
    "adloco",
    "streaming",
    "ddp",
    "byte",
    "tiny",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(NASTY),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
key_names = st.one_of(
    st.sampled_from(KEYS), st.sampled_from(SECTIONS), st.text(max_size=10), st.sampled_from(["a.b.c", "model.x"])
)
overrides = st.builds(
    lambda key, value: f"{key}={value}", key_names, st.one_of(st.sampled_from(NASTY), st.text(max_size=12))
) | st.sampled_from(["novalue", "=1", ".=1", "a..b=1", "model=1", "model.preset.x=1", "run=[]"])


def _nest(pairs: list[tuple[str, Any]]) -> dict[Any, Any]:
    """Dotted keys to nested sections; a collision with a non-section simply overwrites it (more garbage)."""
    data: dict[Any, Any] = {}
    for key, value in pairs:
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data


config_dicts = st.lists(st.tuples(key_names, values), max_size=6).map(_nest) | st.dictionaries(
    st.one_of(st.text(max_size=8), st.integers(), st.none()), values, max_size=4
)


def _one_line(message: str) -> None:
    assert message.strip(), "empty error message"
    assert "\n" not in message.strip(), f"error over several lines: {message!r}"
    assert "Traceback" not in message


def _valid_or_config_error(make: Callable[[], TrainConfig]) -> None:
    try:
        config = make()
    except ConfigError as error:
        _one_line(str(error))
    else:
        assert isinstance(config, TrainConfig)


# -- (a) configuration ------------------------------------------------------------------------------------------


@FUZZ
@given(config_dicts)
@example({"seed": 2**70})
@example({"comm": {"timeout_s": float("inf")}})
@example({"run": {"name": "../escape"}})
@example({"model": [1, 2]})
def test_config_dicts_are_valid_or_one_line_errors(data):
    _valid_or_config_error(lambda: build_config(data))


@FUZZ
@given(st.lists(overrides, max_size=5))
@example(["threads=99999999999"])
@example(["inner.lr=.inf"])
@example(["inner.lr=1e40"])  # finite for Python, beyond float32
@example(["total_tokens=2e4", "workers=1e400"])
@example(["run.name=a/../../b"])
def test_overrides_are_valid_or_one_line_errors(items):
    _valid_or_config_error(lambda: build_config(overrides=items))


@FUZZ
@given(content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
@example(b"method: [\n")
@example(b"- 1\n- 2\n")
@example(b"\xff\xfe\x00")
@example(b"a: &a [*a, *a]\nb: *a\n")
def test_yaml_files_are_valid_or_one_line_errors(scratch, content):
    path = scratch / "fuzz.yaml"
    path.write_bytes(content)
    _valid_or_config_error(lambda: load_config(path))


# The classes of mistake a new user's audit found: empty values, repeated keys, YAML aliases, shard/rank arithmetic.

_SIMPLE_VALUES = st.sampled_from(["", " ", "0", "1", "2", "3", "null", "x", "[]", "1e400", "2e4"])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["workers", "inner.lr", "batch.size", "run.name", "seed"]), _SIMPLE_VALUES),
                max_size=6))  # fmt: skip
def test_empty_and_repeated_keys_are_valid_or_one_line_errors(pairs):
    items = [f"{key}={value}" for key, value in pairs]
    _valid_or_config_error(lambda: (reject_repeated(items), build_config(overrides=items))[1])


@pytest.mark.training
@FUZZ
@given(depth=st.integers(1, 12), width=st.integers(1, 12), where=st.sampled_from(["separator", "workers", "x"]))
def test_yaml_aliases_expand_within_bounds_or_are_refused(scratch, depth, width, where):
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
    path = scratch / "aliases.yaml"
    path.write_text("\n".join([*lines, f"data: {{{where}: *a{depth - 1}}}"]) + "\n")
    try:
        load_config(path)
    except ConfigError as error:
        _one_line(str(error))
        assert len(str(error)) < 300  # an excerpt, never the expansion
    else:
        raise AssertionError("aliases under unknown keys cannot make a valid config")


@FUZZ
@given(
    workers=st.integers(1, 9), trainers=st.integers(1, 3), shards=st.integers(1, 4), world=st.integers(1, 12),
    slots=st.one_of(st.none(), st.integers(1, 4)), torchrun=st.booleans(), elastic=st.booleans(),
)  # fmt: skip
def test_shard_and_rank_arithmetic_fits_or_is_one_line(workers, trainers, shards, world, slots, torchrun, elastic):
    items = [f"workers={workers}", f"trainers={trainers}", f"shards={shards}", f"elastic={str(elastic).lower()}"]
    items += ["method=adloco"] + ([f"slots_per_rank={slots}"] if slots else [])
    try:
        config = build_config(overrides=items)
        check_world(config.world, world if torchrun else 1, torchrun)
    except ConfigError as error:
        _one_line(str(error))
        return
    if not (elastic and torchrun):  # the job fits: every worker has a rank, every rank the same number
        ranks = world if torchrun else 1
        layout = dict(total_workers=config.total_workers, slots_per_rank=config.slots_per_rank, shards=config.shards)
        placed = [hosted_workers(rank, ranks, **layout) for rank in range(ranks)]
        assert sorted(w for hosted in placed for w in hosted) == sorted(list(range(config.total_workers)) * shards)


# -- shared fixture: one real small run, damaged copies of it --------------------------------------------------

RUN = [*FAST, "total_tokens=512", "checkpoint.every=1", "checkpoint.keep=2", "threads=1", "run.trackers=[]"]


def _micro_llama(folder: Path, hidden: int = 16) -> Path:
    """A LLaMA config of a few thousand parameters: checkpoints of ~0.3 MB keep every damaged copy cheap."""
    from transformers import LlamaConfig

    shape = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256}
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, max_position_embeddings=CONTEXT, **shape)
    config.save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A finished run with two checkpoints and an exported model."""
    root = tmp_path_factory.mktemp("runs")
    model = _micro_llama(root / "micro-llama")
    overrides = [*RUN, "model.preset=null", f"model.path={model}", f"run.root={root}", "run.name=good"]
    result = train(build_config(overrides=overrides))
    assert len(list_checkpoints(result.run_dir / "checkpoints")) == 2
    return result.run_dir


def _garbage_dirs(base: Path, good: Path) -> dict[str, Path]:
    """Run directories broken in the ways a crash, a hand edit or a wrong path leaves them."""
    made = {}

    def variant(name: str, damage: Callable[[Path], Any]) -> None:
        path = base / name
        if not path.exists():
            shutil.copytree(good, path)
            damage(path)
        made[name] = path

    def truncate(path: Path, keep: int) -> None:
        path.write_bytes(path.read_bytes()[:keep])

    variant("no-config", lambda d: (d / "config.yaml").unlink())
    variant("config-binary", lambda d: (d / "config.yaml").write_bytes(b"\xff\xfe\x00garbage: ["))
    variant("config-list", lambda d: (d / "config.yaml").write_text("- 1\n"))
    variant("no-final", lambda d: shutil.rmtree(d / "final"))
    variant("final-weights-random", lambda d: (d / "final" / "model.safetensors").write_bytes(bytes(range(256)) * 4))
    variant("final-weights-truncated", lambda d: truncate(d / "final" / "model.safetensors", 3000))
    variant("final-config-not-json", lambda d: (d / "final" / "config.json").write_text("{not json"))
    variant("final-config-empty", lambda d: (d / "final" / "config.json").write_text("{}"))
    variant("tokenizer-a-list", lambda d: (d / "final" / "adloco_tokenizer.json").write_text("[1]"))
    variant("metrics-binary", lambda d: (d / "metrics.jsonl").write_bytes(b"\xe4\x00\xff" * 50))
    variant("metrics-odd-json", lambda d: (d / "metrics.jsonl").write_text('[1]\n3\n{"kind": "round", "round": "x"}\n'))
    variant("metrics-a-folder", lambda d: ((d / "metrics.jsonl").unlink(), (d / "metrics.jsonl").mkdir()))
    variant("no-checkpoints", lambda d: shutil.rmtree(d / "checkpoints"))
    variant("manifest-garbage", lambda d: _damage_all_checkpoints(d, b'{"checkpoints": [1, "x", {"file": 3}]}'))
    return made


def _damage_all_checkpoints(run_dir: Path, manifest: bytes) -> None:
    for path in list_checkpoints(run_dir / "checkpoints"):
        truncate_to = len(path.read_bytes()) // 3
        path.write_bytes(path.read_bytes()[:truncate_to])
    (run_dir / "checkpoints" / MANIFEST).write_bytes(manifest)


@pytest.fixture(scope="module")
def garbage_dirs(good_run, tmp_path_factory) -> dict[str, Path]:
    return _garbage_dirs(tmp_path_factory.mktemp("garbage"), good_run)


# -- (b) command lines ------------------------------------------------------------------------------------------


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # library deprecation warnings are not adloco's output
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, capsys.readouterr().err


def _assert_usage_error(argv: list[str], capsys) -> None:
    code, err = _run_cli(argv, capsys)
    assert code == 2, f"{argv!r} gave exit code {code}: {err[-800:]}"
    _one_line(err)
    assert err.startswith("adloco: error: "), err


def _would_train(items: list[str]) -> bool:
    """Whether ``adloco train ITEMS`` passes config validation (and would start real training)."""
    config_file = items[0] if items and "=" not in items[0] else None
    try:
        load_config(config_file, items[1:] if config_file else items)
    except ConfigError:
        return False
    return True


@FUZZ
@given(st.lists(overrides, min_size=1, max_size=4))
@example(["=\ud800"])  # a lone surrogate (an undecodable argument) quoted in the error must still print
def test_train_with_bad_overrides_exits_2(capsys, scratch, items):
    items = [*items, f"run.root={scratch / 'never'}"]
    if _would_train(items):
        return  # a valid config: real training, not this test's business
    _assert_usage_error(["train", *items], capsys)


RUN_COMMANDS = ["eval", "sample", "plot", "train --resume"]
WORDS = ["train", "eval", "sample", "plot", "--resume", "--tokens", "--temperature", "--top-k", "--seed", "--bogus"]
# For each broken run directory, the commands that cannot work with it. The others are valid use (for example
# resuming a run whose export is damaged) and do real work, so they are left out.
BROKEN = {
    "no-config": ["eval", "train --resume"],
    "config-binary": ["eval", "train --resume"],
    "config-list": ["eval", "train --resume"],
    "no-final": ["eval", "sample"],
    "final-weights-random": ["eval", "sample"],
    "final-weights-truncated": ["eval", "sample"],
    "final-config-not-json": ["eval", "sample"],
    "final-config-empty": ["eval", "sample"],
    "tokenizer-a-list": ["eval", "sample"],
    "metrics-a-folder": ["plot"],
    "no-checkpoints": ["train --resume"],
    "manifest-garbage": ["train --resume"],
}


def _argv(command: str, path: str) -> list[str]:
    if command == "train --resume":
        return ["train", "--resume", path]
    return [command, path, "--tokens", "2"] if command == "sample" else [command, path]


@pytest.mark.parametrize(
    ("name", "command"), [(name, command) for name, commands in BROKEN.items() for command in commands]
)
def test_commands_on_broken_run_dirs_exit_2(capsys, garbage_dirs, name, command):
    _assert_usage_error(_argv(command, str(garbage_dirs[name])), capsys)


@pytest.mark.parametrize("name", ["metrics-binary", "metrics-odd-json"])
def test_plot_refuses_damaged_metrics_with_one_line(capsys, garbage_dirs, name):
    _assert_usage_error(["plot", str(garbage_dirs[name])], capsys)


@FUZZ
@given(command=st.sampled_from(RUN_COMMANDS), where=st.text(max_size=15))
@example(command="train --resume", where="")
@example(command="eval", where="")
def test_commands_on_missing_run_dirs_exit_2(capsys, scratch, command, where):
    path = str(scratch / "missing" / where) if where else ""
    _assert_usage_error(_argv(command, path), capsys)


bad_numbers = st.one_of(
    st.tuples(st.just("--tokens"), st.sampled_from(["-1", "abc", "1.5", "", "nan", "1e3", "--", "1000000000000"])),
    st.tuples(st.just("--temperature"), st.sampled_from(["-1", "nan", "-inf", "inf", "x", ""])),
    st.tuples(st.just("--top-k"), st.sampled_from(["0", "-3", "x", "2.5"])),
    st.tuples(st.just("--seed"), st.sampled_from(["99999999999999999999999", "-99999999999999999999999", "x"])),
    st.tuples(st.just("--bogus"), st.just("1")),
)


@FUZZ
@given(st.lists(bad_numbers, min_size=1, max_size=3))
def test_sample_with_bad_numbers_exits_2(capsys, good_run, flags):
    argv = ["sample", str(good_run), "--tokens", "2"] + [part for flag in flags for part in flag]
    _assert_usage_error(argv, capsys)


@FUZZ
@given(st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=10)), max_size=5))
@example(["train", "--nope"])
@example(["--nope"])
@example([])
@example(["sample"])
@example(["eval", "a", "b"])
def test_random_command_lines_exit_2(capsys, argv):
    if argv and argv[0] == "train" and "--resume" not in argv and _would_train(argv[1:]):
        return  # would train for real
    if any(
        arg.startswith("-") and len(arg) > 2 and ("--help".startswith(arg) or "--version".startswith(arg))
        for arg in argv
    ):
        return
    if any(arg in ("-h", "--help", "--version") for arg in argv) or (
        argv and argv[0] in ("runs", "gradients", "estimate")
    ):
        return  # help and version exit 0; commands owned elsewhere (runs, gradients) are not fuzzed here
    _assert_usage_error(argv, capsys)


# -- (c) data files ---------------------------------------------------------------------------------------------

SHORT = 15  # bytes: both splits of such a text are shorter than one context of 16 plus one


@FUZZ
@given(st.one_of(st.binary(max_size=400), st.text(max_size=400).map(str.encode)))
@example(b"")
@example(b"\x00" * 1000)
@example(b"\xff\xfe" + b"text " * 200)
@example(("caf\u00e9 " * 100).encode("latin-1"))
def test_data_files_load_or_one_line_data_error(scratch, content):
    path = scratch / "data.txt"
    path.write_bytes(content)
    try:
        corpus = Corpus.load(str(path), ByteTokenizer(), 0.1, CONTEXT)
    except DataError as error:
        _one_line(str(error))
    else:
        assert len(corpus.train) > CONTEXT and len(corpus.val) > CONTEXT


bad_data = st.one_of(
    st.binary(max_size=SHORT),  # empty, short, binary, not UTF-8: all too short to train on anyway
    st.binary(min_size=1, max_size=200).map(lambda raw: raw[: len(raw) // 2] + b"\xff\xc0" + raw[len(raw) // 2 :]),
    st.text(max_size=SHORT // 4).map(str.encode),
)


@FUZZ
@given(kind=st.sampled_from(["file", "missing", "folder"]), content=bad_data)
def test_bad_data_through_the_cli_exits_2(capsys, scratch, kind, content):
    path = scratch / "cli-data.txt"
    shutil.rmtree(path, ignore_errors=True)
    path.unlink(missing_ok=True)
    if kind == "file":
        path.write_bytes(content)
    elif kind == "folder":
        path.mkdir()  # an empty folder holds no text
    argv = ["train", *FAST, "run.trackers=[]", f"data.dataset={path}", f"run.root={scratch / 'never'}"]
    _assert_usage_error(argv, capsys)


# -- (d) checkpoint files ---------------------------------------------------------------------------------------


def _resume_copy(good_run: Path, target: Path, data: bytes, with_manifest: bool) -> Path:
    """A run directory whose only checkpoint holds ``data``; the manifest, if kept, has the intact file's checksum."""
    shutil.rmtree(target, ignore_errors=True)
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(good_run / "config.yaml", target / "config.yaml")
    newest = list_checkpoints(good_run / "checkpoints")[-1]
    (target / "checkpoints" / newest.name).write_bytes(data)
    if with_manifest:
        intact = newest.read_bytes()
        entry = {"file": newest.name, "round": 1, "bytes": len(intact), "sha256": hashlib.sha256(intact).hexdigest()}
        (target / "checkpoints" / MANIFEST).write_text(json.dumps({"format_version": 1, "checkpoints": [entry]}))
    return target


def _checkpoint_bytes(good_run: Path) -> bytes:
    return list_checkpoints(good_run / "checkpoints")[-1].read_bytes()


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(min_value=0, max_value=0.999)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 0.999), st.integers(1, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("random"), st.binary(max_size=300)),
)


@FUZZ
@given(damage=damage, with_manifest=st.booleans())
def test_damaged_checkpoints_refuse_to_resume_with_one_line(capsys, scratch, good_run, damage, with_manifest):
    kind, how = damage
    data = bytearray(_checkpoint_bytes(good_run))
    if kind == "truncate":
        data = data[: int(len(data) * how)]
    elif kind == "flip":
        if not with_manifest:
            return  # without a checksum a flipped tensor byte is a valid checkpoint of other numbers
        for offset, mask in {int(len(data) * where): mask for where, mask in how}.items():
            data[offset] ^= mask
    else:
        data = bytearray(how)
    run_dir = _resume_copy(good_run, scratch / "damaged", bytes(data), with_manifest)
    _assert_usage_error(["train", "--resume", str(run_dir)], capsys)


foreign = st.one_of(
    st.dictionaries(st.text(max_size=8), scalars, max_size=4).map(lambda d: {**d, "format_version": 1}),
    st.fixed_dictionaries({"format_version": st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats())}),
    st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=10)),
    st.just({"format_version": 1, "round": 1, "cluster": {"trainers": {0: {}}, "workers": {}}, "counters": {}}),
    st.just(
        {
            "format_version": 1,
            "round": 1,
            "cluster": {"trainers": {0: {}}, "workers": {}},
            "counters": {"round": 1, "tokens": 0, "step": 0, "bytes": 0},
        }
    ),
)


@pytest.mark.training
@FUZZ
@given(obj=foreign)
@example(obj={"format_version": 99})
def test_foreign_torch_files_refuse_to_resume_with_one_line(capsys, scratch, good_run, obj):
    if isinstance(obj, dict) and obj.get("format_version") == 1 and "cluster" not in obj:
        obj = {k: v for k, v in obj.items() if k not in ("round", "cluster", "counters")}
    run_dir = _resume_copy(good_run, scratch / "foreign", _torch_bytes(obj), with_manifest=False)
    _assert_usage_error(["train", "--resume", str(run_dir)], capsys)


@pytest.mark.parametrize("change", ["model", "workers: 2", "fewer workers", "context: 16"])
def test_checkpoint_of_another_shape_refuses_to_resume_with_one_line(capsys, scratch, good_run, change):
    run_dir = _resume_copy(good_run, scratch / "other-shape", _checkpoint_bytes(good_run), with_manifest=True)
    config = (run_dir / "config.yaml").read_text()
    if change == "model":  # the same architecture, twice as wide
        wider = _micro_llama(scratch / "wider-llama", hidden=32)
        old = f"path: {good_run.parent / 'micro-llama' / 'config.json'}"
        replacement = f"path: {wider}"
    elif change == "fewer workers":  # used to end in a KeyError from the cluster's worker plan
        old, replacement = "workers: 2", "workers: 1"
    else:
        old, replacement = change, change.replace("2", "3").replace("16", "32")
    assert old in config
    (run_dir / "config.yaml").write_text(config.replace(old, replacement, 1))
    _assert_usage_error(["train", "--resume", str(run_dir)], capsys)
