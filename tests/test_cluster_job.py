"""adloco as a cluster job: progress when piped, the run lock, resume with overrides, stop signals, preflight."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from adloco.checkpoint import list_checkpoints
from adloco.cli import main
from adloco.config import ConfigError, build_config, load_config
from adloco.config.input import layered
from adloco.run.preflight import check_memory, estimate_memory
from adloco.run.runs import RUNNING_FILE, lock_run
from adloco.run.training import train
from benchmarks.reliability import final_params
from tests.conftest import FAST, adloco_process


def _adloco(*args, cwd, timeout=300):
    return adloco_process(*args, cwd=cwd, timeout=timeout)


def _cli(capsys, *args, cwd: Path):
    """The command line in this process (the same code as ``adloco``, without a second torch import)."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(layered(list(args)))  # a script's defaults with the test's settings laid over them
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def _one_line_error(result, fragment: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("adloco: error: ") and fragment in last, last
    return last


# -- numbers that used to pass validation -------------------------------------------------------------------------


def test_integer_counts_may_be_written_in_scientific_notation(tmp_path):
    assert build_config(overrides=["total_tokens=2e4", "workers=1e1"]).total_tokens == 20_000
    path = tmp_path / "c.yaml"
    path.write_text("total_tokens: 2e4\ninner:\n  lr: 1e-3\nrun:\n  name: '2e4'\n")
    config = load_config(path)
    assert config.total_tokens == 20_000 and config.inner.lr == 1e-3 and config.run.name == "2e4"
    with pytest.raises(ConfigError, match="fractional part"):
        build_config(overrides=["total_tokens=2.5e0"])


@pytest.mark.parametrize(("override", "key"), [("inner.lr=1e40", "inner.lr"), ("inner.eps=1e300", "inner.eps")])
def test_reals_beyond_float32_are_refused_with_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .* is beyond what float32 holds"):
        build_config(overrides=[override])


def test_memory_estimate_names_the_numbers():
    estimate = estimate_memory(parameters=1_000_000, workers=3, trainers=2, batch=4, context=16, hidden=8, layers=2)
    assert estimate.per_worker == 16_000_000 + 8 * 4 * 16 * 8 * 2 * 4 and estimate.per_trainer == 8_000_000
    assert estimate.total == 3 * estimate.per_worker + 2 * estimate.per_trainer
    check_memory(estimate, available=estimate.total)  # fits exactly
    check_memory(estimate, available=None)  # unknown: not refused
    with pytest.raises(ConfigError, match=r"at least 0\.1 GiB \(3 worker\(s\) × 15 MiB \+ 2 trainer\(s\) × 8 MiB\)"):
        check_memory(estimate, available=estimate.total - 1)


def test_a_rank_that_cannot_hold_its_workers_is_refused_before_building_them(tmp_path, capsys):
    result = _cli(capsys, "train", *FAST, "workers=100000", "model.preset=small", "run.progress=true", cwd=tmp_path)
    _one_line_error(result, "would need at least")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()  # refused before


def test_the_memory_preflight_comes_before_any_model_is_built(tmp_path, capsys, monkeypatch):
    from adloco.run import preflight
    from adloco.workers.tasks import Task

    def built(*_):
        raise AssertionError("a model was built before the memory preflight")

    monkeypatch.setattr(Task, "build_model", built)
    monkeypatch.setattr(preflight, "available_memory", lambda: 1 << 20)
    result = _cli(capsys, "train", *FAST, f"run.root={tmp_path}", cwd=tmp_path)
    _one_line_error(result, "but 0.0 GiB is available")


def test_a_resume_whose_budget_is_spent_says_so(stopped_run, tmp_path, capsys):
    run = Path(shutil.copytree(stopped_run, tmp_path / "copy"))
    result = _cli(capsys, "train", "--resume", str(run), "total_tokens=128", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "total_tokens=128 is spent already: the checkpoint holds 256 tokens; nothing is trained" in result.stderr
    assert "after 256 tokens" in result.stdout


def test_a_budget_below_one_step_says_so_and_trains_that_step(tmp_path, capsys):
    result = _cli(capsys, "train", *FAST, "total_tokens=10", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "total_tokens=10 is less than one inner step (64 tokens" in result.stderr
    assert "after 64 tokens" in result.stdout


# -- progress without a terminal ----------------------------------------------------------------------------------


@pytest.mark.training
def test_piped_training_prints_the_run_folder_first_then_plain_progress_lines(tmp_path, capsys):
    overrides = [*FAST, "total_tokens=4096", "run.progress=true", "run.progress_every_s=0.01", "run.name=piped"]
    result = _cli(capsys, "train", *overrides, cwd=tmp_path)  # captured: not a terminal, as under nohup
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0] == f"adloco: run directory {Path('runs') / 'piped'}"
    progress = [line for line in lines if line.startswith("round ")]
    assert len(progress) >= 3 and "tokens 4,096/4,096 (100.0%)" in progress[-1]
    assert all(" tok/s · loss " in line and "ETA" in line and len(line) < 160 for line in progress[:-1])
    assert progress[-1].endswith("· done · ETA -")
    logged = (tmp_path / "runs" / "piped" / "train.log").read_text()
    assert "round 1 · tokens" in logged and "tokens 4,096/4,096" in logged


def test_the_bar_stays_readable_at_80_columns():
    from rich.console import Console

    from adloco.metrics.writer import RunDisplay

    console = Console(width=80, force_terminal=True, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    with RunDisplay(console, "diloco", total=1_536_000, done=0, enabled=True, every_s=1e9, log=lambda line: None) as d:
        d.show(11, 92_160, "loss 2.345 val 2.401 b=16")
    text = console.export_text()
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert "92.2k/1.54M" in last and "r12 loss 2.345 val 2.401 b=16" in last and "…" not in last


# -- one process per run folder ------------------------------------------------------------------------------------


@pytest.mark.process
def test_a_run_folder_has_one_live_trainer_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from adloco.run.runs import lock_run; from pathlib import Path; "
         "lock_run(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"is being trained by process {holder.pid}, started "):
            lock_run(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up: its RUNNING stays, its flock went with it.
    assert json.loads((tmp_path / RUNNING_FILE).read_text())["pid"] == holder.pid
    lock = lock_run(tmp_path)
    assert lock.took_over is not None and f"process {holder.pid}" in lock.took_over
    assert json.loads((tmp_path / RUNNING_FILE).read_text())["pid"] == os.getpid()
    lock.release(None)
    assert not (tmp_path / RUNNING_FILE).exists()


def test_resuming_a_run_that_is_training_is_refused(tmp_path, capsys):
    run = train(build_config(overrides=[*FAST, "total_tokens=128", f"run.root={tmp_path}", "run.name=r"])).run_dir
    lock = lock_run(run)  # as a training process would hold it (flock: another open of the file conflicts)
    try:
        result = _cli(capsys, "train", "--resume", str(run), cwd=tmp_path)
        _one_line_error(result, f"is being trained by process {os.getpid()}")
    finally:
        lock.release(None)


# -- resume with overrides -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A finished short run; resuming it with a larger budget continues it."""
    root = tmp_path_factory.mktemp("resume")
    overrides = [*FAST, "total_tokens=256", "checkpoint.every=1", "run.plots=false", f"run.root={root}", "run.name=r"]
    return train(build_config(overrides=overrides)).run_dir


def test_resume_with_a_larger_budget_continues_and_records_the_change(stopped_run, tmp_path, capsys):
    result = _cli(capsys, "train", "--resume", str(stopped_run), "total_tokens=512", "eval.every=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resuming with changed settings: eval.every: 2 -> 1; total_tokens: 256 -> 512" in result.stderr
    assert "after 512 tokens" in result.stdout
    assert load_config(stopped_run / "config.yaml").total_tokens == 512  # the next resume starts from here
    assert "total_tokens: 256 -> 512" in (stopped_run / "train.log").read_text()


def test_resume_refuses_a_change_that_does_not_fit_the_checkpoint(stopped_run, tmp_path, capsys):
    before = (stopped_run / "config.yaml").read_text()
    result = _cli(capsys, "train", "--resume", str(stopped_run), "workers=4", cwd=tmp_path)
    _one_line_error(result, "'workers' cannot change when a run resumes unless the run was started with elastic=true")
    # A hand edit of config.yaml (workers 2 -> 1) is caught against the checkpoint's own config.
    (stopped_run / "config.yaml").write_text(before.replace("workers: 2", "workers: 1"))
    try:
        result = _cli(capsys, "train", "--resume", str(stopped_run), cwd=tmp_path)
        _one_line_error(result, "the checkpoint was written with another setting: workers 2, now 1; only total_")
    finally:
        (stopped_run / "config.yaml").write_text(before)
    assert not (stopped_run / "FAILED").exists() and not (stopped_run / RUNNING_FILE).exists()


# -- signals -------------------------------------------------------------------------------------------------------


def _start(tmp_path, name, overrides):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [
        sys.executable,
        "-m",
        "adloco",
        "train",
        *layered(overrides, [f"run.root={tmp_path}", f"run.name={name}"]),
    ]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stderr_once_ended(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The child's stderr after it exits; one still running after ``timeout`` is killed and its stderr shown."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        err = proc.communicate()[1]
        raise AssertionError(
            f"the run did not exit within {timeout:.0f} s of the signal; its stderr:\n{err[-4000:]}"
        ) from None


def _wait_for_round(metrics: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"kind": "round"' in metrics.read_text():
            return
        time.sleep(0.05)
    raise AssertionError("the run wrote no round in time")


@pytest.mark.process
def test_sigterm_checkpoints_at_the_round_end_and_the_resume_is_bit_identical(tmp_path):
    overrides = [*FAST, "total_tokens=4096", "checkpoint.every=1000", "threads=1", "run.plots=false"]
    reference = train(build_config(overrides=[*overrides, f"run.root={tmp_path}", "run.name=reference"]))
    proc = _start(tmp_path, "stopped", overrides)
    _wait_for_round(tmp_path / "stopped" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    err = _stderr_once_ended(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    checkpoints = list_checkpoints(tmp_path / "stopped" / "checkpoints")
    assert len(checkpoints) == 1  # checkpoint.every=1000: this one is the signal's
    run_dir, round_number = tmp_path / "stopped", int(checkpoints[0].stem.split("_")[1])
    assert err.strip().splitlines()[-1] == (
        f"adloco: stopped on SIGTERM: checkpoint of round {round_number} in {run_dir}; "
        f"resume with: adloco train --resume {run_dir}"
    )
    assert not (tmp_path / "stopped" / "FAILED").exists()
    resumed = _adloco("train", "--resume", str(tmp_path / "stopped"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    expected, got = final_params(reference.run_dir), final_params(tmp_path / "stopped")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.process
def test_sigusr1_stops_the_same_way(tmp_path):
    proc = _start(tmp_path, "stopped", [*FAST, "total_tokens=100000", "checkpoint.every=1000", "threads=1"])
    _wait_for_round(tmp_path / "stopped" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGUSR1)
    err = _stderr_once_ended(proc)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert len(list_checkpoints(tmp_path / "stopped" / "checkpoints")) == 1
    assert err.strip().splitlines()[-1].startswith("adloco: stopped on SIGUSR1: checkpoint of round ")


@pytest.mark.process
def test_ctrl_c_names_the_newest_checkpoint_or_says_there_is_none(tmp_path):
    overrides = [*FAST, "total_tokens=100000", "checkpoint.every=1", "threads=1"]
    proc = _start(tmp_path, "interrupted", overrides)
    _wait_for_round(tmp_path / "interrupted" / "metrics.jsonl", proc)
    while not list_checkpoints(tmp_path / "interrupted" / "checkpoints"):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = _stderr_once_ended(proc)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("adloco: interrupted: checkpoint of round ")
    assert last.endswith(f"resume with: adloco train --resume {tmp_path / 'interrupted'}")
    # One numbering everywhere: the round the message names is the file's, the metrics' and --checkpoint's.
    named = int(last.removeprefix("adloco: interrupted: checkpoint of round ").split()[0])
    run_dir = tmp_path / "interrupted"
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == f"round_{named:06d}.pt"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"][:named] == list(range(1, named + 1))
    flags = ["--samples", "4", "--batch-sizes", "1,2", "--repeats", "4", "--out", str(tmp_path / "g")]
    assert main(["gradients", str(run_dir), "--checkpoint", str(named), *flags]) == 0
    proc = _start(tmp_path, "early", [*overrides, "checkpoint.every=100000"])
    _wait_for_round(tmp_path / "early" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    err = _stderr_once_ended(proc)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == (
        f"adloco: interrupted: no checkpoint was written yet in {tmp_path / 'early'}; start the run again"
    )


def test_time_based_checkpoints_beside_the_round_cadence(tmp_path):
    overrides = [*FAST, "checkpoint.every=1000", "checkpoint.every_minutes=1e-9", "checkpoint.keep=100"]
    run = train(build_config(overrides=[*overrides, f"run.root={tmp_path}", "run.name=t", "run.plots=false"]))
    assert len(list_checkpoints(run.run_dir / "checkpoints")) == run.rounds  # every round end is past due


# -- the export ----------------------------------------------------------------------------------------------------


def test_the_byte_export_loads_with_auto_tokenizer_and_follows_the_umask(tmp_path):
    from transformers import AutoTokenizer

    old = os.umask(0o027)
    try:
        run = train(build_config(overrides=[*FAST, "total_tokens=128", f"run.root={tmp_path}", "run.name=b"]))
    finally:
        os.umask(old)
    tokenizer = AutoTokenizer.from_pretrained(run.run_dir / "final")
    text = "Héllo, wörld ✓\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) and tokenizer.decode(ids) == text
    assert stat.S_IMODE((run.run_dir / "final" / "model.safetensors").stat().st_mode) == 0o640


# -- the command line ----------------------------------------------------------------------------------------------


@pytest.mark.process
def test_print_config_shows_the_resolved_config_and_trains_nothing(tmp_path):
    result = _adloco("train", "--print-config=all", "total_tokens=2e4", "method=adloco", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["total_tokens"] == 20_000 and (printed["trainers"], printed["workers"]) == (1, 4)
    assert printed["batch"]["test"] == "norm" and printed["batch"]["controller"] == "time"
    assert not (tmp_path / "runs").exists()
    # a bare --print-config is the basic tier, and does not take the override after it as its value
    basic = _adloco("train", "--print-config", "method=adloco", "batch.statistics.eta=0.5", cwd=tmp_path)
    assert basic.returncode == 0, basic.stderr
    shown = yaml.safe_load(basic.stdout)
    assert shown["method"] == "adloco" and shown["outer"] == {"lr": 1.0, "momentum": 0.5}
    assert "eta" not in shown["batch"] and "comm" not in shown
    assert basic.stdout.rstrip().endswith("shown; --print-config=all prints every one")


def test_quiet_and_verbose(tmp_path, capsys):
    overrides = [*FAST, "total_tokens=256", "run.progress=true", "run.progress_every_s=0.01"]
    quiet = _cli(capsys, "train", *overrides, "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "" and "final validation loss" in quiet.stdout
    verbose = _cli(capsys, "train", *overrides, "-v", cwd=tmp_path)
    assert verbose.returncode == 0 and "start: method=diloco trainers=1 workers=2" in verbose.stderr
    assert "Traceback" not in verbose.stderr


def test_a_damaged_newest_checkpoint_is_reported_on_the_console_and_an_older_one_used(tmp_path, capsys):
    overrides = [*FAST, "total_tokens=512", "checkpoint.every=1", f"run.root={tmp_path}", "run.name=d"]
    run = train(build_config(overrides=overrides)).run_dir
    older, newest = list_checkpoints(run / "checkpoints")[-2:]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(data))
    result = _cli(capsys, "train", "--resume", str(run), "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    said = [
        f"adloco: warning: checkpoint '{newest}' is damaged (checksum mismatch)",
        f"adloco: resuming from the checkpoint of round {older.stem.split('_')[1].lstrip('0')}, the newest intact "
        "one; the rounds after it are trained again",
    ]
    assert result.stderr.splitlines()[:2] == said  # even with -q: work was lost and a file is damaged
    logged = (run / "train.log").read_text()
    assert all(line.removeprefix("adloco: ") in logged for line in said)


def test_runs_counts_tokens_as_the_bar_does():
    from adloco.run.runs import RunSummary, _tokens_text

    summary = RunSummary("r", "r", "diloco", "finished", 20_736, 20_000, rounds=1, val_loss=None, modified=0.0)
    assert _tokens_text(summary) == "20.7k/20k"
