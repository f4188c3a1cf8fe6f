"""An unwritable run directory stops a run before it starts; a full disk at a checkpoint or metrics write stops
it with one line naming the write (exit code 1), keeps the previous checkpoint and manifest intact, and
``--resume`` then ends bit-identical to a run that never failed."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import adloco.checkpoint
import adloco.run.training
from adloco.checkpoint import MANIFEST, list_checkpoints, read_manifest
from adloco.cli import main
from adloco.config import build_config
from adloco.config.input import layered
from adloco.metrics.writer import MetricsWriter
from adloco.run.training import train
from tests.conftest import FAST
from tests.test_fuzz import _micro_llama

RUN = [*FAST, "checkpoint.every=1", "checkpoint.keep=2", "threads=1", "run.trackers=[]", "model.preset=null"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return _micro_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_path) -> dict[str, torch.Tensor]:
    """Final parameters of the same run that never failed."""
    root = tmp_path_factory.mktemp("reference")
    result = train(build_config(overrides=[*RUN, f"model.path={model_path}", f"run.root={root}", "run.name=ref"]))
    return load_file(result.run_dir / "final" / "model.safetensors")


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(layered(argv))  # the run's settings with the test's laid over them
    return code, capsys.readouterr().err


def _args(model_path: Path, root: Path, name: str = "run") -> list[str]:
    return ["train", *RUN, f"model.path={model_path}", f"run.root={root}", f"run.name={name}"]


def _assert_intact_and_resumable(run_dir: Path, capsys, reference: dict[str, torch.Tensor]) -> None:
    checkpoints = run_dir / "checkpoints"
    entries = read_manifest(checkpoints)
    assert entries and [e["file"] for e in entries] == [p.name for p in list_checkpoints(checkpoints)]
    for entry in entries:  # every checkpoint the manifest names is complete
        data = (checkpoints / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"]
        assert adloco.checkpoint.store.sha256_of(data) == entry["sha256"]
    assert not [p.name for p in checkpoints.iterdir() if ".tmp-" in p.name], "a partial temporary file was left"
    code, err = _cli(["train", "--resume", str(run_dir)], capsys)
    assert code == 0, err
    got = load_file(run_dir / "final" / "model.safetensors")
    assert all(torch.equal(reference[k], got[k]) for k in reference)


def _assert_one_line(err: str, *parts: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


# -- an unwritable run.root -------------------------------------------------------------------------------------


def test_run_root_under_a_regular_file_stops_before_training(tmp_path, capsys, model_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, err = _cli(_args(model_path, blocker / "runs"), capsys)
    assert code == 2
    _assert_one_line(err, "adloco: error: run directories cannot be created under run.root", f"'{blocker}' is a file")


@contextlib.contextmanager
def _read_only_folder(path: Path):
    """A folder that refuses writes for real: a read-only tmpfs for root (whom chmod does not stop), else chmod."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"running as root but cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.process
def test_read_only_run_root_stops_before_training(tmp_path, capsys, model_path):
    with _read_only_folder(tmp_path / "ro") as root:
        with pytest.raises(OSError):  # the folder really refuses writes
            (root / "probe").write_text("x")
        code, err = _cli(_args(model_path, root), capsys)
        assert code == 2
        _assert_one_line(err, "adloco: error: run directories cannot be created", f"'{root}' is not writable")
        assert not list(root.iterdir())


@pytest.mark.process
def test_resume_into_a_read_only_run_dir_stops_before_training(tmp_path, capsys, model_path):
    """The preflight probe on --resume: a run directory that became read-only is reported, not trained into."""
    code, err = _cli([*_args(model_path, tmp_path), "total_tokens=256"], capsys)
    assert code == 0, err
    run_dir = tmp_path / "run"
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=False)
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(run_dir)], capture_output=True)
        if remount.returncode != 0:
            subprocess.run(["umount", str(run_dir)], check=False)
            pytest.skip(f"running as root but cannot bind-mount read-only: {remount.stderr.decode().strip()}")
    else:
        (run_dir / "checkpoints").chmod(0o500)
    try:
        code, err = _cli(["train", "--resume", str(run_dir)], capsys)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(run_dir)], check=True)
        else:
            (run_dir / "checkpoints").chmod(0o700)
    assert code == 2
    _assert_one_line(err, "adloco: error: run directory", "is not writable")


# -- a full disk, simulated: always runs ---------------------------------------------------------------------------


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_at_a_checkpoint_write(tmp_path, capsys, monkeypatch, model_path, reference):
    """The third checkpoint write runs out of space half-way through the file."""
    real_open = open
    calls = {"checkpoints": 0}

    class HalfWritten(io.FileIO):
        def write(self, data) -> int:
            super().write(bytes(data)[: len(data) // 2])
            raise _enospc()

    def fake_open(path, mode="r", *args, **kwargs):
        if Path(path).name.startswith(".round_") and "w" in mode:
            calls["checkpoints"] += 1
            if calls["checkpoints"] == 3:
                return HalfWritten(path, "w")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(adloco.checkpoint.store, "open", fake_open, raising=False)
    code, err = _cli(_args(model_path, tmp_path), capsys)
    assert code == 1
    _assert_one_line(err, "adloco: error: no space left on device while writing checkpoint", "round_000003.pt")
    assert err.endswith(f"; free some space and continue with --resume {tmp_path / 'run'}\n")
    monkeypatch.undo()
    assert [e["round"] for e in read_manifest(tmp_path / "run" / "checkpoints")] == [1, 2]
    _assert_intact_and_resumable(tmp_path / "run", capsys, reference)


def test_full_disk_at_the_first_checkpoint_says_to_start_again(tmp_path, capsys, monkeypatch, model_path):
    """--resume could not continue a run that has no checkpoint: the line must not advise it."""

    def full(*_, **__):
        raise _enospc()

    monkeypatch.setattr(adloco.checkpoint.files, "atomic_write_bytes", full)
    code, err = _cli(_args(model_path, tmp_path), capsys)
    assert code == 1
    _assert_one_line(err, "no space left on device while writing checkpoint", "round_000001.pt")
    assert err.endswith("; free some space and start the run again (no checkpoint yet)\n")


def test_full_disk_at_a_metrics_write(tmp_path, capsys, monkeypatch, model_path, reference):
    """metrics.jsonl stops taking data after its first round: the run stops at the next flush."""
    real_init = MetricsWriter.__init__

    class FillingUp(io.StringIO):
        def __init__(self, handle) -> None:
            super().__init__()
            self.handle, self.records = handle, 0

        def write(self, text: str) -> int:
            self.records += 1
            if self.records > 5:
                raise _enospc()
            return self.handle.write(text)

        def flush(self) -> None:
            if self.records > 5:
                raise _enospc()
            self.handle.flush()

        def close(self) -> None:
            self.handle.close()
            super().close()

    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        self.handle = FillingUp(self.handle)

    monkeypatch.setattr(MetricsWriter, "__init__", init)
    code, err = _cli(_args(model_path, tmp_path), capsys)
    assert code == 1
    _assert_one_line(err, "adloco: error: no space left on device while writing metrics", "metrics.jsonl")
    assert err.endswith(f"; free some space and continue with --resume {tmp_path / 'run'}\n")
    monkeypatch.undo()
    _assert_intact_and_resumable(tmp_path / "run", capsys, reference)


# -- a full disk for real: a small tmpfs (root only) ---------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    path = tmp_path / "tmpfs"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the simulated ENOSPC tests above still run)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(folder: Path) -> Path:
    """Write a file until the file system is full; returns it (delete it to free the space)."""
    filler = folder / "filler"
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


@pytest.mark.process
def test_real_full_disk_at_a_checkpoint_write(small_tmpfs, capsys, monkeypatch, model_path, reference):
    real_save = adloco.run.training.save_checkpoint
    state = {"saves": 0, "filler": None}

    def save_on_a_filling_disk(directory, *args, **kwargs):
        state["saves"] += 1
        if state["saves"] == 3:  # the disk fills up just before the third checkpoint
            state["filler"] = _fill(small_tmpfs)
        return real_save(directory, *args, **kwargs)

    monkeypatch.setattr(adloco.run.training, "save_checkpoint", save_on_a_filling_disk)
    code, err = _cli(_args(model_path, small_tmpfs), capsys)
    assert code == 1
    _assert_one_line(err, "adloco: error: no space left on device while writing checkpoint")
    monkeypatch.undo()
    run_dir = small_tmpfs / "run"
    manifest = json.loads((run_dir / "checkpoints" / MANIFEST).read_text())
    assert [e["round"] for e in manifest["checkpoints"]] == [1, 2]
    state["filler"].unlink()  # space freed, as a user would
    _assert_intact_and_resumable(run_dir, capsys, reference)
