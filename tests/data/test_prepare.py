"""adloco prepare: sources to token shards, a manifest, resumable, the same output with any number of processes."""

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

import adloco.data.documents as documents
import adloco.data.encoding as encoding
import adloco.data.prepare as prepare_module
from adloco.data.encoding import choose_engine
from adloco.data.prepare import PrepareSettings, prepare, summary
from adloco.data.prepare_progress import PrepareProgress
from adloco.data.sources import resolve_source
from adloco.data.token_files import MANIFEST, open_token_source, read_manifest
from adloco.errors import DataError
from tests.conftest import adloco_process

QUIET = Console(quiet=True)


def _folder(root, count=30, size=40):
    root.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "def", "return", "(x)", "\n"]
    for i in range(count):
        text = " ".join(rng.choice(words, size + i)) + "\n"
        (root / f"doc{i:03d}.txt").write_text(text)
    return root


def _tokens(folder, split="train"):
    source = open_token_source(str(folder), None, 0.1, verify=True)
    part = source.train if split == "train" else source.val
    return part.gather(np.array([0]), len(part))[0]


def _same_output(a, b):
    """Two prepared folders hold the same shards, byte for byte, and the same manifest apart from timings."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert [r.__dict__ for r in ma.train] == [r.__dict__ for r in mb.train]
    assert [r.__dict__ for r in ma.val] == [r.__dict__ for r in mb.val]
    for record in [*ma.train, *ma.val]:
        assert (a / record.file).read_bytes() == (b / record.file).read_bytes()


def test_a_folder_prepares_into_shards_with_an_end_of_document_id_after_each_document(tmp_path):
    source = _folder(tmp_path / "text")
    out = tmp_path / "out"
    settings = PrepareSettings(str(source), "byte", shard_tokens=1000, val_every=7, val_documents=3)
    manifest = prepare(settings, out, QUIET)
    texts = [(source / f"doc{i:03d}.txt").read_bytes() for i in range(30)]
    held = {0, 7, 14}  # every 7th document until three are held out
    assert _tokens(out).tolist() == list(b"".join(t + b"\0" for i, t in enumerate(texts) if i not in held))
    assert _tokens(out, "val").tolist() == list(b"".join(texts[i] + b"\0" for i in sorted(held)))
    assert all(r.tokens == 1000 for r in manifest.train[:-1]) and manifest.train[-1].tokens <= 1000
    assert sum(r.documents for r in manifest.train) == 27 and sum(r.documents for r in manifest.val) == 3
    data = json.loads((out / MANIFEST).read_text())
    assert data["format"] == "adloco-tokens" and data["complete"] and data["dtype"] == "uint16"
    assert data["train"]["tokens"] == len(_tokens(out)) and data["source"]["kind"] == "folder"
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    tokens = len(_tokens(out))
    assert summary(manifest, out).startswith(
        f"prepared {out}: training {len(manifest.train)} shards, {tokens:,} tokens"
    )


@pytest.mark.process
def test_the_output_does_not_depend_on_the_number_of_processes(tmp_path):
    source = _folder(tmp_path / "text", count=60)
    base = PrepareSettings(str(source), "bpe", vocab_size=300, shard_tokens=700, val_every=10, val_documents=2)
    prepare(base, tmp_path / "one", QUIET)
    prepare(PrepareSettings(**{**base.__dict__, "processes": 2}), tmp_path / "two", QUIET)
    _same_output(tmp_path / "one", tmp_path / "two")


def test_a_trained_bpe_is_saved_and_the_fast_encoder_gives_its_ids(tmp_path):
    from transformers import AutoTokenizer

    source = _folder(tmp_path / "text", count=40, size=200)
    out = tmp_path / "out"
    manifest = prepare(PrepareSettings(str(source), "bpe", vocab_size=400, val_every=1000), out, QUIET)
    assert manifest.tokenizer["encoder"] == "tiktoken" and manifest.dtype == "uint16"
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tokenizer) == manifest.vocab_size <= 400  # a small corpus offers fewer merges than asked for
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert manifest.eot_id == eot
    expected = []
    for i in range(1, 40):  # document 0 is the validation split
        expected += tokenizer((source / f"doc{i:03d}.txt").read_text(), add_special_tokens=False)["input_ids"] + [eot]
    assert _tokens(out).tolist() == expected


def test_the_fast_encoder_is_only_used_where_it_agrees(tmp_path, monkeypatch):
    source = _folder(tmp_path / "text", count=10)
    prepare(PrepareSettings(str(source), "bpe", vocab_size=300, val_every=1000), tmp_path / "out", QUIET)
    file = str(tmp_path / "out" / "tokenizer" / "tokenizer.json")
    pieces = documents.pieces(resolve_source(str(source)), PrepareSettings(str(source)))
    assert choose_engine("bpe", file, pieces) == "tiktoken"
    real = encoding.Encoder.ids

    def off_by_one(self, texts):
        ids = real(self, texts)
        return [i + 1 for i in ids] if self.engine == "tiktoken" else ids

    monkeypatch.setattr(encoding.Encoder, "ids", off_by_one)
    pieces = documents.pieces(resolve_source(str(source)), PrepareSettings(str(source)))
    assert choose_engine("bpe", file, pieces) == "tokenizers"
    assert choose_engine("byte", None, iter([])) == "byte"


def test_a_single_text_file_holds_out_its_tail_and_is_read_in_pieces(tmp_path, monkeypatch):
    lines = [f"line {i} {'x' * (i % 13)}\n" for i in range(400)]
    path = tmp_path / "book.txt"
    path.write_text("".join(lines))
    monkeypatch.setattr(documents, "PIECE_BYTES", 97)  # many pieces, each cut after a line end
    out = tmp_path / "out"
    prepare(PrepareSettings(str(path), "byte", val_fraction=0.25, shard_tokens=500), out, QUIET)
    raw = path.read_bytes()
    cut = raw.index(b"\n", int(len(raw) * 0.75) - 1) + 1
    assert _tokens(out).tolist() == list(raw[:cut] + b"\0")
    assert _tokens(out, "val").tolist() == list(raw[cut:] + b"\0")


def test_jsonl_parquet_and_datasets_sources(tmp_path):
    rows = [{"text": f"row {i} " + "words " * i, "id": i} for i in range(20)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    outs = {}
    for name, source, extra in (
        ("jsonl", tmp_path / "rows.jsonl", {}),
        ("parquet", tmp_path / "rows.parquet", {}),
        ("hf", "hf:json", {"hf_data_files": str(tmp_path / "rows.jsonl")}),
    ):
        outs[name] = tmp_path / name
        prepare(PrepareSettings(str(source), "byte", val_every=4, val_documents=10, **extra), outs[name], QUIET)
    expected = b"".join(r["text"].encode() + b"\0" for i, r in enumerate(rows) if i % 4)
    for out in outs.values():
        assert _tokens(out).tolist() == list(expected)
    _same_output(outs["jsonl"], outs["parquet"])


def test_unreadable_folder_files_are_skipped_and_counted(tmp_path):
    source = _folder(tmp_path / "text", count=5)
    (source / "blob.txt").write_bytes(b"\x00\x01binary")
    (source / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    manifest = prepare(PrepareSettings(str(source), "byte", val_every=1000), tmp_path / "out", QUIET)
    assert manifest.stats["skipped_files"] == 2
    assert "2 unreadable files skipped" in summary(manifest, tmp_path / "out")


def _fail_after(monkeypatch, shards):
    real = prepare_module.write_tokens
    calls = []

    def write(path, chunks):
        if len(calls) == shards:
            (path.with_name(f".{path.name}.tmp")).write_bytes(b"torn")  # what a dying write leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append(path)
        return real(path, chunks)

    monkeypatch.setattr(prepare_module, "write_tokens", write)


def test_a_full_disk_stops_with_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    source = _folder(tmp_path / "text", count=50)
    settings = PrepareSettings(str(source), "byte", shard_tokens=600, val_every=10, val_documents=2)
    prepare(settings, tmp_path / "clean", QUIET)
    with monkeypatch.context() as patch:
        _fail_after(patch, 4)
        with pytest.raises(DataError, match="the disk is full writing .*; free space and run the same command"):
            prepare(settings, tmp_path / "out", QUIET)
    partial = read_manifest(tmp_path / "out")
    assert not partial.complete and len(partial.train) + len(partial.val) == 4
    prepare(settings, tmp_path / "out", QUIET)
    _same_output(tmp_path / "clean", tmp_path / "out")
    assert read_manifest(tmp_path / "out").complete


def test_an_output_folder_holding_something_else_is_refused(tmp_path):
    source = _folder(tmp_path / "text", count=8)
    out = tmp_path / "out"
    prepare(PrepareSettings(str(source), "byte", val_every=1000), out, QUIET)
    with pytest.raises(
        DataError, match="holds another prepare \\(its shard_tokens, tokenizer, val_every, vocab_size differ\\)"
    ):
        prepare(PrepareSettings(str(source), "bpe", vocab_size=300, shard_tokens=5), out, QUIET)
    printed = Console(file=io.StringIO())
    prepare(PrepareSettings(str(source), "byte", val_every=1000, processes=2), out, printed)  # workers do not count
    assert "is prepared already" in printed.file.getvalue()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="is not empty and holds no manifest.json"):
        prepare(PrepareSettings(str(source), "byte"), tmp_path / "busy", QUIET)
    with pytest.raises(DataError, match="--val-every must be at least 1"):
        prepare(PrepareSettings(str(source), "byte", val_every=0), tmp_path / "x", QUIET)
    with pytest.raises(DataError, match="gave no training tokens"):
        prepare(PrepareSettings(str(source), "byte", val_every=1), tmp_path / "y", QUIET)


@pytest.mark.process
def test_a_killed_prepare_resumes_by_redoing_only_its_torn_shard(tmp_path):
    source = tmp_path / "big.txt"
    rng = np.random.default_rng(1)
    with source.open("w") as handle:  # about 24 MB of lines
        for _ in range(24):
            handle.write("\n".join(" ".join(rng.choice(["a", "bb", "ccc"], 100)) for _ in range(3_500)) + "\n")
    args = ["prepare", str(source), "--tokenizer", "byte", "--shard-tokens", "1e6", "--processes", "1", "-q"]
    assert adloco_process(*args, "--out", str(tmp_path / "clean")).returncode == 0
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen([sys.executable, "-m", "adloco", *args, "--out", str(out)], env=env)
    deadline = time.monotonic() + 120
    while not (out / "train_000003.bin").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the prepare finished before it could be killed"
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("train_*.bin")}
    finished = adloco_process(*args, "--out", str(out))
    assert finished.returncode == 0, finished.stderr
    _same_output(tmp_path / "clean", out)
    kept = [name for name, mtime in written.items() if (out / name).stat().st_mtime_ns == mtime]
    assert len(kept) >= 3  # the shards the manifest had recorded were not written again


@pytest.mark.process
def test_the_command_line_says_what_it_wrote_and_refuses_bad_input_with_one_line(tmp_path):
    source = _folder(tmp_path / "text", count=6)
    done = adloco_process("prepare", str(source), "--out", str(tmp_path / "out"), "--tokenizer", "byte",
                          "--val-every", "3", "--processes", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prepared {tmp_path / 'out'}: training 1 shard") and "bytes per token" in done.stdout
    missing = adloco_process("prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o2"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad = adloco_process("prepare", str(source), "--out", str(tmp_path / "o3"), "--shard-tokens", "1.5")
    assert bad.returncode == 2 and "not a whole number" in bad.stderr


def test_progress_lines_name_the_rates_and_the_time_left():
    console = Console(file=io.StringIO(), width=200)
    with PrepareProgress(console, total=4_000_000, every_s=0) as progress:
        time.sleep(0.01)
        progress.update(1_000_000, 250_000)
    line = console.file.getvalue()
    assert line.startswith("adloco: prepare: 25.0% · 1.0 MB · ") and "MB/s" in line and "tokens/s" in line
    assert "ETA" in line


@pytest.mark.parametrize("engine", ["tiktoken", "tokenizers"])
def test_special_token_text_in_a_document_is_text_for_both_encoders(tmp_path, engine):
    source = _folder(tmp_path / "text", count=10)
    out = tmp_path / "out"
    manifest = prepare(PrepareSettings(str(source), "bpe", vocab_size=300, val_every=1000), out, QUIET)
    file = str(out / "tokenizer" / "tokenizer.json")
    encoder = encoding.Encoder(engine, file, manifest.eot_id, "uint16")
    piece = documents.Piece("train", 0, 0, True, "before <|endoftext|> after")
    ((_, ids, size),) = encoder.encode([piece])
    assert ids[-1] == manifest.eot_id and manifest.eot_id not in ids[:-1].tolist() and size == 26


def test_a_prepare_killed_before_its_first_manifest_starts_again(tmp_path):
    source = _folder(tmp_path / "text", count=6)
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)  # what a kill between the tokenizer and the manifest leaves
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    prepare(PrepareSettings(str(source), "byte", val_every=1000), out, QUIET)
    assert read_manifest(out).complete


def test_the_output_may_not_lie_inside_the_source_and_paths_name_one_prepare(tmp_path, monkeypatch):
    source = _folder(tmp_path / "text", count=6)
    with pytest.raises(DataError, match="lies inside the source"):
        prepare(PrepareSettings(str(source), "byte", suffixes=("*",)), source / "tokens", QUIET)
    prepare(PrepareSettings(str(source), "byte", val_every=1000), tmp_path / "out", QUIET)
    monkeypatch.chdir(tmp_path)
    printed = Console(file=io.StringIO())
    prepare(PrepareSettings("text", "byte", val_every=1000), tmp_path / "out", printed)  # relative: the same one
    assert "is prepared already" in printed.file.getvalue()


def test_a_line_of_megabytes_is_cut_between_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "PIECE_BYTES", 64)
    monkeypatch.setattr(documents, "LONG_LINE_BYTES", 256)
    text = ("naïve " * 200).strip() + "ü" * 300 + "\nend\n"
    path = tmp_path / "one_line.txt"
    path.write_text(text)
    pieces = list(documents._file_pieces(path))
    assert "".join(pieces) == text and max(len(p.encode()) for p in pieces) < 256 + 64
