import json

import pytest
import torch

from adloco.config import build_config
from adloco.data import ByteTokenizer, Corpus, DataError, iter_records, load_corpus, read_text, resolve_source
from tests.data.helpers import document, write_jsonl, write_parquet


def test_folder_joins_sorted_text_files_recursively(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.bin").write_bytes(b"\x00ignored")
    (tmp_path / "z.txt").write_text("third")
    source = resolve_source(str(tmp_path))
    assert source.kind == "folder"
    assert source.read_text() == "first\n\nsecond\n\nthird"


def test_jsonl_and_parquet_give_the_same_text(tmp_path):
    texts = write_jsonl(tmp_path / "d.jsonl", 40)
    assert write_parquet(tmp_path / "d.parquet", 40, row_group_size=7) == texts
    expected = "\n\n".join(texts)
    assert read_text(str(tmp_path / "d.jsonl")) == expected
    assert read_text(str(tmp_path / "d.parquet")) == expected
    # Lazy readers start anywhere: Parquet skips whole row groups from its metadata.
    rows = list(iter_records(tmp_path / "d.parquet", "parquet", start=23))
    assert [r["id"] for r in rows] == list(range(23, 40))
    assert [r["text"] for r in iter_records(tmp_path / "d.jsonl", "jsonl", start=39)] == [texts[39]]


def test_text_field_is_configurable(tmp_path):
    texts = write_jsonl(tmp_path / "d.jsonl", 30, field="content")
    config = build_config(overrides=[f"data.dataset={tmp_path / 'd.jsonl'}", "data.text_field=content"])
    corpus = load_corpus(config.data, ByteTokenizer(), 16)
    assert ByteTokenizer().decode(corpus.train[:40]) == texts[0][:40]


def test_hugging_face_datasets_from_local_files(tmp_path):
    texts = write_jsonl(tmp_path / "d.jsonl", 30)
    overrides = ["data.dataset=hf:json", f"data.hf_data_files={tmp_path / 'd.jsonl'}"]
    config = build_config(overrides=overrides)
    corpus = load_corpus(config.data, ByteTokenizer(), 16)
    direct = Corpus.load(str(tmp_path / "d.jsonl"), ByteTokenizer(), 0.1, 16)
    assert torch.equal(corpus.train, direct.train) and torch.equal(corpus.val, direct.val)
    # A folder written by save_to_disk loads too (hf_name is the same as hf:NAME).
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    saved = build_config(overrides=[f"data.hf_name={tmp_path / 'saved'}"])
    assert torch.equal(load_corpus(saved.data, ByteTokenizer(), 16).train, direct.train)
    streamed = list(resolve_source(f"hf:{tmp_path / 'saved'}").documents(start=28, streaming=True))
    assert streamed == texts[28:]
    # load_dataset(streaming=True) gives an IterableDataset: resuming at a document skips to it.
    lazy = resolve_source("hf:json", hf_data_files=str(tmp_path / "d.jsonl"))
    assert list(lazy.documents(start=25, streaming=True)) == texts[25:]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.jsonl", b"", "has no rows"),
        ("a.jsonl", b"\n\n", "has no rows"),
        ("a.jsonl", b'{"body": "x"}\n', "has no field 'text' \\(fields: body\\)"),
        ("a.jsonl", b'{"text": 3}\n', "is int, not text"),
        ("a.jsonl", b'{"text": "ok"}\n{"text": \n', "line 2 is not valid JSON"),
        ("a.jsonl", b'{"text": "\xff\xfe"}\n', "line 1 is not UTF-8"),
        ("a.jsonl", b"[1, 2]\n", "line 1 is not a JSON object"),
        ("a.parquet", b"PAR1 this is not parquet", "not a valid Parquet file"),
        ("a.txt", b"\x00\x01binary", "binary"),
    ],
)
def test_bad_sources_are_one_line_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as caught:
        Corpus.load(str(path), ByteTokenizer(), 0.1, 16)
    assert "\n" not in str(caught.value)


def test_parquet_without_the_text_field_and_with_no_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x" * 100]}), tmp_path / "f.parquet")
    with pytest.raises(DataError, match="no field 'text'"):
        read_text(str(tmp_path / "f.parquet"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="has no rows"):
        read_text(str(tmp_path / "e.parquet"))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        resolve_source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"has no \*\.txt or \*\.md files"):
        resolve_source(str(tmp_path / "empty"))
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": document(0, 2)}) + "\n")
    with pytest.raises(DataError, match="fewer than one context of 16"):
        Corpus.load(str(tmp_path / "short.jsonl"), ByteTokenizer(), 0.1, 16)
    with pytest.raises(DataError, match="hf:NAME"):
        resolve_source("hf:")
    with pytest.raises(DataError, match="cannot be loaded"):
        read_text(f"hf:{tmp_path / 'no-such-dataset'}")
