"""Bad data and worlds are refused before torch is imported: one line, exit code 2, in well under a second."""

import json
import subprocess
import sys

import numpy as np
import pytest

from adloco.config import build_config
from adloco.data.preflight import check_data
from adloco.errors import DataError

# adloco train in a fresh interpreter; the error must come before torch or transformers is imported
PROBE = """
import sys
from adloco.cli import main
code = main(["train", *sys.argv[1:]])
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("HEAVY", heavy, "CODE", code)
"""


def _refused(tmp_path, *overrides: str) -> str:
    root = [] if any(o.startswith(("run.root=", "--resume")) for o in overrides) else [f"run.root={tmp_path / 'runs'}"]
    done = subprocess.run([sys.executable, "-c", PROBE, *overrides, *root],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "HEAVY [] CODE 2" in done.stdout, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adloco: error: "), done.stderr
    assert not (tmp_path / "runs").exists()
    return lines[0]


@pytest.mark.process
def test_each_bad_source_is_named_before_torch_loads(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "rows.jsonl").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "notext").mkdir()
    (tmp_path / "notext" / "image.png").write_bytes(b"\x89PNG")
    cases = {
        "nope.txt": "does not exist",
        "empty.txt": "is empty",
        "blob.txt": "looks binary",
        "latin.txt": "is not UTF-8 text",
        "short.txt": "the training split has 8 tokens, fewer than one context of 64 plus one",
        "rows.jsonl": "has no rows",
        "bad.jsonl": "line 1 is not valid JSON",
        "broken.parquet": "is not a valid Parquet file",
        "notext": "has no *.txt or *.md files",
    }
    for name, expected in cases.items():
        assert expected in _refused(tmp_path, f"data.dataset={tmp_path / name}"), name


@pytest.mark.process
def test_bad_token_files_and_worlds_are_named_before_torch_loads(tmp_path):
    (tmp_path / "shards").mkdir()
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "shards" / "a.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    assert "has no manifest.json" in _refused(tmp_path, f"data.dataset={tmp_path / 'shards'}")
    assert "odd number of bytes" in _refused(tmp_path, f"data.dataset={tmp_path / 'odd.bin'}")
    assert "needs torchrun" in _refused(tmp_path, "shards=2")
    assert "do not fill 1 rank(s) with 2 slots each" in _refused(tmp_path, "workers=3", "slots_per_rank=2")


def test_token_files_shorter_than_a_context_and_what_is_left_to_the_corpus(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    config = build_config(overrides=[f"data.dataset={tmp_path / 't.bin'}"])
    with pytest.raises(DataError, match="the validation split has 10 tokens, fewer than one context of 64"):
        check_data(config.data, 64)
    check_data(config.data, None)  # a context not known yet (a model from a path): the corpus checks it later
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    check_data(build_config(overrides=[f"data.dataset={tmp_path / 'rows.jsonl'}"]).data, 64)  # tokens unknown: ok
    check_data(build_config(overrides=["data.dataset=hf:some/name"]).data, 64)  # the datasets library answers


@pytest.mark.process
def test_a_run_directory_that_cannot_be_made_or_resumed_is_named_before_torch_loads(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    assert "run.root" in _refused(tmp_path, f"run.root={tmp_path / 'a_file' / 'runs'}")
    assert f"'{tmp_path / 'a_file'}' is a file" in _refused(tmp_path, f"run.root={tmp_path / 'a_file' / 'runs'}")
    started = tmp_path / "started"  # a run that died before its first checkpoint
    (started / "checkpoints").mkdir(parents=True)
    (started / "config.yaml").write_text(build_config().to_yaml())
    assert "has no checkpoint to resume from" in _refused(tmp_path, "--resume", str(started))
    assert "is a file, not a run directory" in _refused(tmp_path, "--resume", str(tmp_path / "a_file"))
