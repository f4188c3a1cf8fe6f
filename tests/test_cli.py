import subprocess
import sys

import pytest

from adloco.cli import main
from adloco.config import build_config
from adloco.config.input import layered
from adloco.run.training import train
from tests.conftest import FAST, adloco_process


def _run(*args, cwd=None, timeout=120):
    return adloco_process(*args, cwd=cwd, timeout=timeout)


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_train_prints_final_validation_loss_and_perplexity(tmp_path):
    result = _run("train", *FAST, "total_tokens=128", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "final validation loss" in result.stdout and "perplexity" in result.stdout
    assert (tmp_path / "runs").is_dir()


@pytest.mark.process
@pytest.mark.parametrize("args", [["train", "workers=0"], ["train", "--resume", "/nonexistent/run"], ["runs", "x"]])
def test_bad_config_and_run_paths_fail_before_torch_is_imported(args):
    """A typo must not wait for torch and transformers to load (seconds); the error types live in a light module."""
    probe = (
        f"import sys; from adloco.cli import main; code = main({args!r}); print('torch' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == "False" and result.stderr.startswith("adloco: error: ")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["train", "workers", "4"],
            "config file 'workers' does not exist; settings are written key=value, e.g. workers=4",
        ),
        (["train", "workers="], "override 'workers=' has no value; give one, or leave the key out for its default"),
        (["train", "workers=2", "workers=3"], "'workers' is given twice: 'workers=2' and 'workers=3'; give it once"),
        (["train", "--resume", ""], "--resume needs a run directory, got an empty path"),
        (["train", "--resume", "a-file"], "'a-file' is a file, not a run directory"),
    ],
)
def test_mistakes_a_new_user_makes_get_a_line_that_says_what_to_do(args, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a run\n")
    assert main(args) == 2
    assert capsys.readouterr().err == f"adloco: error: {line}\n"
    assert not (tmp_path / "runs").exists()  # nothing started, not even a default run


def test_an_existing_run_name_is_refused_rather_than_renamed(tmp_path, capsys):
    args = ["train", *layered(FAST, ["total_tokens=128", f"run.root={tmp_path}", "run.name=r"])]
    assert main(args) == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"adloco: error: run directory '{tmp_path / 'r'}' already exists; continue it with --resume " \
                  f"{tmp_path / 'r'}, or give another run.name\n"  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no r-2 that `adloco eval r` would not read


def test_resume_names_an_unknown_key_as_unknown_and_workers_as_an_elastic_setting(tmp_path, capsys):
    run = train(build_config(overrides=[*FAST, "total_tokens=128", f"run.root={tmp_path}", "run.name=r"])).run_dir
    assert main(["train", "--resume", str(run), "inner.lrr=1"]) == 2
    assert capsys.readouterr().err == "adloco: error: unknown key 'inner.lrr'\n"
    assert main(["train", "--resume", str(run), "workers=3"]) == 2
    assert "cannot change when a run resumes unless the run was started with elastic=true" in capsys.readouterr().err


def test_a_named_run_that_stopped_before_its_first_checkpoint_is_started_over(tmp_path, capsys):
    args = ["train", *layered(FAST, ["total_tokens=128", f"run.root={tmp_path}", "run.name=r"])]
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)  # what a start that died in its first round leaves
    (tmp_path / "r" / "config.yaml").write_text("method: diloco\n")
    (tmp_path / "r" / "metrics.jsonl").write_text('{"kind": "step", "round": 1}\n')
    assert main(args) == 0
    assert f"'{tmp_path / 'r'}' held no checkpoint from an earlier start; starting it over" in capsys.readouterr().err
    assert (tmp_path / "r" / "final").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    (tmp_path / "notes").mkdir()
    assert main([*args[:-1], "run.name=notes"]) == 2
    assert "notes' already exists and is not a run directory" in capsys.readouterr().err
