"""``adloco runs``: status of real small runs and of hand-damaged copies; the RUNNING / FAILED markers."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from adloco.checkpoint import CheckpointError
from adloco.cli import main
from adloco.config import build_config
from adloco.run.runs import FAILED_FILE, RUNNING_FILE, find_runs, mark_ended, mark_running, summarize_run
from adloco.run.training import train
from tests.conftest import FAST


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A finished run plus copies of it damaged in the ways real runs end up."""
    root = tmp_path_factory.mktemp("runs")
    done = train(
        build_config(overrides=[*FAST, "total_tokens=512", "checkpoint.every=1", f"run.root={root}", "run.name=done"])
    ).run_dir
    assert not (done / RUNNING_FILE).exists() and not (done / FAILED_FILE).exists()

    stopped = root / "stopped"  # killed after its first checkpoint: no final model, no final record
    shutil.copytree(done, stopped)
    shutil.rmtree(stopped / "final")
    records = (stopped / "metrics.jsonl").read_text().splitlines()
    first_round = next(i for i, line in enumerate(records) if json.loads(line)["kind"] == "round")
    (stopped / "metrics.jsonl").write_text("\n".join(records[: first_round + 1]) + '\n{"kind": "st')  # torn line
    for path in sorted((stopped / "checkpoints").glob("round_*.pt"))[1:]:
        path.unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (stopped / RUNNING_FILE).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))

    running = root / "running"
    shutil.copytree(stopped, running)
    mark_running(running)  # this very process is alive

    failed = root / "failed"
    shutil.copytree(stopped, failed)
    mark_running(failed)
    mark_ended(failed, RuntimeError("non-finite losses\nsecond line"))

    damaged = root / "damaged"  # unreadable config, no checkpoint, garbage marker
    damaged.mkdir()
    (damaged / "config.yaml").write_text("method: [unclosed\n")
    (damaged / "metrics.jsonl").write_bytes(b"\xff\xfe garbage\n")
    (damaged / RUNNING_FILE).write_text("not json")

    (root / "notes").mkdir()  # not a run directory
    (root / ".jobs").mkdir()
    return root


@pytest.mark.process
def test_status_of_each_run(root):
    runs = {run.name: run for run in find_runs(root)}
    assert set(runs) == {"done", "stopped", "running", "failed", "damaged"}
    done = runs["done"]
    assert (done.status, done.method, done.tokens, done.total_tokens) == ("finished", "diloco", 512, 512)
    final = [json.loads(line) for line in (root / "done" / "metrics.jsonl").read_text().splitlines()][-1]
    assert done.rounds == final["rounds"] and done.val_loss == final["val_loss"][str(final["best_trainer"])]
    assert runs["stopped"].status == "stopped at round 1" and runs["stopped"].rounds == 1
    assert runs["stopped"].tokens == 256 and runs["stopped"].val_loss is None  # round 1 was not evaluated
    assert runs["running"].status == "running"
    assert runs["failed"].status == "failed" and runs["failed"].error == "RuntimeError: non-finite losses"
    assert not (root / "failed" / RUNNING_FILE).exists()
    damaged = runs["damaged"]
    assert (damaged.status, damaged.method, damaged.tokens) == ("failed", None, None)


def test_a_stopped_run_that_resumes_is_no_longer_failed(tmp_path):
    mark_running(tmp_path)
    mark_ended(tmp_path, ValueError("boom"))
    assert (tmp_path / FAILED_FILE).read_text() == "ValueError: boom\n"
    mark_running(tmp_path)  # --resume
    assert not (tmp_path / FAILED_FILE).exists()
    mark_ended(tmp_path, KeyboardInterrupt())  # Ctrl-C stops, it does not fail
    assert not (tmp_path / FAILED_FILE).exists() and not (tmp_path / RUNNING_FILE).exists()


@pytest.mark.process
def test_cli_table_and_json(root, capsys):
    assert main(["runs", str(root)]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in ("done", "stopped", "running", "failed", "damaged"))
    assert "finished" in table and "stopped at round 1" in table and "notes" not in table
    assert main(["runs", str(root), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {row["name"]: row["status"] for row in rows}["done"] == "finished"
    assert all(set(row) >= {"method", "tokens", "total_tokens", "rounds", "val_loss", "modified"} for row in rows)


def test_bad_root_is_a_one_line_error(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "file").write_text("x")
    assert main(["runs", str(tmp_path / "file")]) == 2
    assert "not a folder" in capsys.readouterr().err
    with pytest.raises(CheckpointError):
        find_runs(tmp_path / "missing")
    assert main(["runs", str(tmp_path)]) == 0 and "no runs" in capsys.readouterr().out


@pytest.mark.process
def test_a_run_directory_given_as_root_lists_itself(root):
    (run,) = find_runs(root / "done")
    assert run == summarize_run(root / "done")


@pytest.mark.process
def test_a_run_with_damaged_metrics_says_so(root, tmp_path, capsys):
    garbled = tmp_path / "garbled"
    shutil.copytree(root / "stopped", garbled)
    (garbled / "metrics.jsonl").write_bytes(b"\xe4\x00\xff" * 50)
    summary = summarize_run(garbled)
    assert summary.status == "stopped at round 1"
    assert summary.error == "metrics.jsonl is damaged: it is not UTF-8 text (byte 0)"
    assert main(["runs", str(tmp_path)]) == 0
    assert "stopped at round 1 (metrics.jsonl is damaged" in capsys.readouterr().out
