"""benchmarks/python_corpus.py: which stdlib files make the second corpus, their order, and that adloco reads it."""

import hashlib
import json
from pathlib import Path

import python_corpus

from adloco import build_config
from adloco.data import source_from_config


def _fake_stdlib(root: Path) -> Path:
    files = {
        "os.py": "import sys\n",
        "json/decoder.py": "class JSONDecoder:\n    pass\n",
        "site-packages/numpy/core.py": "third = 'party'\n",  # not the standard library
        "__pycache__/os.cpython.py": "cached\n",
        "notes.txt": "not python\n",
        "empty.py": "\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes(b"# caf\xe9\n")  # not UTF-8, as a few of CPython's test files are
    return root


def test_the_corpus_holds_the_utf8_stdlib_sources_in_hashed_order(tmp_path):
    stdlib = _fake_stdlib(tmp_path / "lib")
    path, info = python_corpus.build(tmp_path / "out", stdlib)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    names = ["os.py", "json/decoder.py"]
    assert [row["path"] for row in rows] == sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    assert {row["path"]: row["text"] for row in rows}["json/decoder.py"] == "class JSONDecoder:\n    pass\n"
    assert info["files"] == 2 and info["characters"] == len("import sys\n") + len("class JSONDecoder:\n    pass\n")
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.name == f"python-stdlib-{info['python']}.jsonl"
    (stdlib / "extra.py").write_text("x = 1\n")
    assert python_corpus.build(tmp_path / "out", stdlib) == (path, info)  # built once per Python version
    config = build_config(overrides=[f"data.dataset={path}"])
    text = source_from_config(config.data).read_text()
    assert "import sys" in text and "class JSONDecoder" in text
