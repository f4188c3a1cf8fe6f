"""A Hub name on a machine that cannot reach the Hub: one line, at once, instead of half a minute of retries."""

import os
import socket
import subprocess
import sys

import pytest


def _closed_port() -> int:
    with socket.socket() as sock:  # bound and closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.process
@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("data.dataset=hf:someone/no-such-data", "dataset 'someone/no-such-data' is not in the local Hugging Face"),
        ("data.tokenizer=hf:someone/no-such-tokenizer", "tokenizer 'someone/no-such-tokenizer' is not in the local"),
    ],
)
def test_an_unreachable_hub_is_one_line_within_seconds(tmp_path, setting, line):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}  # not offline already
    endpoint = f"http://127.0.0.1:{_closed_port()}"  # loopback only: connection refused, as an offline machine's
    env.update({"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "PYTHONWARNINGS": "ignore"})
    result = subprocess.run(
        [sys.executable, "-m", "adloco", "train", setting, f"run.root={tmp_path / 'runs'}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(f"adloco: error: {line}") and result.stderr.count("\n") == 1, result.stderr
    assert f"the Hub ({endpoint}) cannot be reached" in result.stderr
