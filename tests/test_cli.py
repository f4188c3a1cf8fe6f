import os
import subprocess
import sys

import pytest

from adloco.config import build_config
from adloco.training import train
from tests.conftest import FAST


def _run(*args, cwd=None, timeout=120):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "adloco", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["train", "workers=0"], "workers"),
        (["train", "bogus.key=1"], "unknown key 'bogus'"),
        (["train", "missing.yaml"], "does not exist"),
        (["train", "data.dataset=/nonexistent/file.txt"], "does not exist"),
        (["train", "--resume", "/nonexistent/run"], "does not exist"),
        (["train", "--bogus-flag"], "unrecognized arguments"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, fragment, tmp_path):
    result = _run(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and fragment in lines[-1]
    assert "Traceback" not in result.stderr
    assert len(lines) <= 3  # argparse prints its usage line before the error


def test_damaged_checkpoint_is_reported(tmp_path):
    # The run is made in this process (the CLI's own training path is tested below); only the resume is a CLI call.
    run = train(
        build_config(overrides=[*FAST, "total_tokens=128", f"run.root={tmp_path / 'runs'}", "run.name=r"])
    ).run_dir
    for checkpoint in (run / "checkpoints").glob("*.pt"):
        checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    result = _run("train", "--resume", str(run), cwd=tmp_path)
    assert result.returncode == 2
    assert "damaged" in result.stderr and "Traceback" not in result.stderr


def test_train_prints_final_validation_loss_and_perplexity(tmp_path):
    result = _run("train", *FAST, "total_tokens=128", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "final validation loss" in result.stdout and "perplexity" in result.stdout
    assert (tmp_path / "runs").is_dir()


@pytest.mark.parametrize("args", [["train", "workers=0"], ["train", "--resume", "/nonexistent/run"], ["runs", "x"]])
def test_bad_config_and_run_paths_fail_before_torch_is_imported(args):
    """A typo must not wait for torch and transformers to load (seconds); the error types live in a light module."""
    probe = (
        f"import sys; from adloco.cli import main; code = main({args!r}); print('torch' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == "False" and result.stderr.startswith("adloco: error: ")
