"""Token files as training reads them: prepared folders, nanoGPT's raw .bin, llm.c shards and .npy arrays."""

import json

import numpy as np
import pytest
from rich.console import Console

from adloco.config import ConfigError, build_config
from adloco.data.corpus import TokenCorpus
from adloco.data.prepare import PrepareSettings, prepare
from adloco.data.token_files import (
    MANIFEST,
    names_token_files,
    open_token_files,
    open_token_source,
    prepared_folder,
    run_tokenizer,
)
from adloco.data.tokenization import ByteTokenizer
from adloco.errors import DataError

QUIET = Console(quiet=True)


def _llmc(path, tokens, magic=20240520, version=1, dtype=np.uint16, count=None):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as handle:
        handle.write(header.tobytes())
        handle.write(np.asarray(tokens, dtype=dtype).tobytes())
    return path


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "text").mkdir()
    for i in range(12):
        (tmp_path / "text" / f"{i:02d}.txt").write_text(f"document {i} " + "abcdefgh" * (10 + i) + "\n")
    out = tmp_path / "tokens"
    prepare(PrepareSettings(str(tmp_path / "text"), "byte", shard_tokens=300, val_every=5, val_documents=2), out, QUIET)
    return out


def test_a_prepared_folder_reads_as_its_shards_in_order(prepared, tmp_path):
    source = open_token_source(str(prepared), None, 0.1, verify=True)
    texts = [(tmp_path / "text" / f"{i:02d}.txt").read_bytes() for i in range(12)]
    train = b"".join(t + b"\0" for i, t in enumerate(texts) if i not in (0, 5))  # every 5th held out, two at most
    val = texts[0] + b"\0" + texts[5] + b"\0"
    assert len(source.train.files) > 1  # several shards, read as one sequence
    assert source.train.gather(np.array([0]), len(train))[0].tolist() == list(train)
    assert source.val.gather(np.array([0]), len(val))[0].tolist() == list(val)
    assert source.max_id() == max(train + val)


def test_windows_span_files(tmp_path):
    a, b = np.arange(0, 10, dtype=np.uint16), np.arange(10, 25, dtype=np.uint16)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    tokens = open_token_files(str(tmp_path / "*.bin"))
    assert len(tokens) == 25 and tokens.windows(4) == 6
    rows = tokens.gather(np.array([8, 0, 20]), 5)
    assert rows.tolist() == [[8, 9, 10, 11, 12], [0, 1, 2, 3, 4], [20, 21, 22, 23, 24]]
    part = tokens.part(7, 13)
    assert part.gather(np.array([0]), 6)[0].tolist() == [7, 8, 9, 10, 11, 12]


def test_nanogpt_bin_npy_and_llmc_shards(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50_000, 1_000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids.astype(np.uint32))
    _llmc(tmp_path / "gpt2.bin", ids)
    _llmc(tmp_path / "llama.bin", ids.astype(np.uint32) + 100_000, magic=20240801, version=7, dtype=np.uint32)
    for name, offset in (("train.bin", 0), ("train.npy", 0), ("gpt2.bin", 0), ("llama.bin", 100_000)):
        array = open_token_files(str(tmp_path / name))
        assert array.gather(np.array([0]), 1000)[0].tolist() == (ids.astype(np.int64) + offset).tolist()
    assert open_token_files(str(tmp_path / "llama.bin")).files[0].dtype == np.dtype("<u4")
    # validation: the trailing fraction, or a file of its own
    source = open_token_source(str(tmp_path / "train.bin"), None, 0.1, True)
    assert (len(source.train), len(source.val)) == (900, 100)
    source = open_token_source(str(tmp_path / "train.bin"), str(tmp_path / "gpt2.bin"), 0.1, True)
    assert (len(source.train), len(source.val)) == (1000, 1000)


def test_bad_token_files_are_named(tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    _llmc(tmp_path / "v9.bin", ids, version=9)
    with pytest.raises(DataError, match="unknown llm.c header .*version 9"):
        open_token_files(str(tmp_path / "v9.bin"))
    _llmc(tmp_path / "short.bin", ids, count=200)
    with pytest.raises(DataError, match="header says 200 tokens, the file holds 100"):
        open_token_files(str(tmp_path / "short.bin"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="odd number of bytes"):
        open_token_files(str(tmp_path / "odd.bin"))
    np.save(tmp_path / "matrix.npy", np.zeros((3, 3), dtype=np.uint16))
    with pytest.raises(DataError, match="1-D integer array"):
        open_token_files(str(tmp_path / "matrix.npy"))
    np.save(tmp_path / "floats.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(DataError, match="1-D integer array"):
        open_token_files(str(tmp_path / "floats.npy"))
    with pytest.raises(DataError, match="matches no token files"):
        open_token_files(str(tmp_path / "nothing*.bin"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("text")
    assert not names_token_files(str(tmp_path / "folder"))  # a text folder stays a text folder
    (tmp_path / "shards").mkdir()
    ids.tofile(tmp_path / "shards" / "a.bin")
    assert names_token_files(str(tmp_path / "shards")) and prepared_folder(str(tmp_path / "shards")) is None


def test_a_damaged_prepared_folder_is_refused(prepared):
    shard = prepared / "train_000001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-2])  # torn
    with pytest.raises(DataError, match="'train_000001.bin' has 598 bytes, the manifest says 600"):
        open_token_source(str(prepared), None, 0.1, verify=False)
    shard.write_bytes(raw[:-2] + b"zz")  # same size, other content
    with pytest.raises(DataError, match="'train_000001.bin' does not match its sha256"):
        open_token_source(str(prepared), None, 0.1, verify=True)
    open_token_source(str(prepared), None, 0.1, verify=False)  # data.verify=size checks sizes only
    shard.unlink()
    with pytest.raises(DataError, match="shard 'train_000001.bin' is missing"):
        open_token_source(str(prepared), None, 0.1, verify=False)


def _edit_manifest(folder, **changes):
    path = folder / MANIFEST
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_manifest_that_is_not_ours_unfinished_or_of_an_unknown_dtype_is_refused(prepared):
    _edit_manifest(prepared, dtype="int8")
    with pytest.raises(DataError, match="names dtype 'int8'"):
        open_token_source(str(prepared), None, 0.1, True)
    _edit_manifest(prepared, dtype="uint16", version=99)
    with pytest.raises(DataError, match="token format version 99"):
        open_token_source(str(prepared), None, 0.1, True)
    _edit_manifest(prepared, version=1, complete=False)
    with pytest.raises(DataError, match="is not finished; run adloco prepare again"):
        open_token_source(str(prepared), None, 0.1, True)
    (prepared / MANIFEST).write_text("{}")
    with pytest.raises(DataError, match="is not an adloco token manifest"):
        open_token_source(str(prepared), None, 0.1, True)
    (prepared / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="cannot be read as JSON"):
        open_token_source(str(prepared), None, 0.1, True)


def test_a_run_takes_the_prepared_folders_tokenizer_and_refuses_another(prepared, tmp_path):
    assert build_config(overrides=[f"data.dataset={prepared}"]).data.tokenizer == "byte"
    assert run_tokenizer(prepared, "byte") == "byte"
    with pytest.raises(DataError, match="'bpe' is not the one .* prepared with the tokenizer 'byte'"):
        run_tokenizer(prepared, "bpe")
    with pytest.raises(ConfigError, match="data.tokenizer 'bpe' is not the one"):
        build_config(overrides=[f"data.dataset={prepared}", "data.tokenizer=bpe"])
    with pytest.raises(ConfigError, match="data.streaming: token files are read a window at a time already"):
        build_config(overrides=[f"data.dataset={prepared}", "data.streaming=true"])


def test_token_ids_beyond_the_vocabulary_are_refused_before_training(tmp_path):
    np.array([1, 2, 300, 4] * 50, dtype=np.uint16).tofile(tmp_path / "t.bin")
    config = build_config(overrides=[f"data.dataset={tmp_path / 't.bin'}", "model.context=8"])
    with pytest.raises(DataError, match="holds token id 300, at or above the vocabulary of tokenizer 'byte' \\(256\\)"):
        TokenCorpus.load(config.data, ByteTokenizer(), 8, 0)


def test_a_validation_split_shorter_than_a_context_is_refused(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    config = build_config(overrides=[f"data.dataset={tmp_path / 't.bin'}"])
    with pytest.raises(DataError, match="the validation split has 10 tokens, fewer than one context of 16"):
        TokenCorpus.load(config.data, ByteTokenizer(), 16, 0)


def test_a_folder_of_shards_without_a_manifest_is_refused_with_the_way_out(tmp_path):
    (tmp_path / "shards").mkdir()
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "shards" / "fineweb_train_000001.bin")
    with pytest.raises(DataError, match="has no manifest.json: prepare it with adloco prepare, or name its training"):
        open_token_source(str(tmp_path / "shards"), None, 0.1, True)
    glob_name = str(tmp_path / "shards" / "*train*.bin")
    assert len(open_token_source(glob_name, None, 0.5, True).train) == 50


def test_a_separate_validation_file_is_for_token_files_and_classification_only(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    config = build_config(overrides=[f"data.dataset={tmp_path / 'train.bin'}", f"data.val_dataset={tmp_path}/v.bin"])
    assert config.data.val_dataset.endswith("v.bin")
    (tmp_path / "book.txt").write_text("text")
    with pytest.raises(ConfigError, match="data.val_dataset: a separate validation file is read by"):
        build_config(overrides=[f"data.dataset={tmp_path / 'book.txt'}", f"data.val_dataset={tmp_path}/v.bin"])


def test_a_header_of_llmc_layout_with_an_unknown_magic_is_refused(tmp_path):
    _llmc(tmp_path / "future.bin", np.arange(100), magic=20250101, version=1)
    with pytest.raises(DataError, match="starts with an unknown header \\(magic 20250101, version 1"):
        open_token_files(str(tmp_path / "future.bin"))


def test_a_reader_of_many_shards_keeps_few_files_open(tmp_path, monkeypatch):
    import adloco.data.token_files as token_files

    monkeypatch.setattr(token_files, "OPEN_FILES", 3)
    for i in range(10):
        np.arange(i * 10, i * 10 + 10, dtype=np.uint16).tofile(tmp_path / f"s{i:02d}.bin")
    tokens = open_token_files(str(tmp_path / "s*.bin"))
    rows = tokens.gather(np.array([95, 5, 45, 0, 85]), 5)
    assert rows[:, 0].tolist() == [95, 5, 45, 0, 85] and rows[1].tolist() == [5, 6, 7, 8, 9]
    assert len(tokens._open) == 3
    with pytest.raises(IndexError):
        tokens.gather(np.array([97]), 5)


def test_a_relative_glob_is_kept_absolute_in_the_config(tmp_path, monkeypatch):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "part_0.bin")
    monkeypatch.chdir(tmp_path)
    assert build_config(overrides=["data.dataset=part_*.bin"]).data.dataset == str(tmp_path / "part_*.bin")
