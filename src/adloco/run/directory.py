"""The run directory: made (or a named one started over), locked for one process, its config and log written;
and what a restarted torchrun attempt finds of the one its first attempt made."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from adloco.checkpoint import CheckpointError, atomic_write_bytes, list_checkpoints
from adloco.checkpoint.names import check_resumable
from adloco.comm.base import Communicator
from adloco.comm.distributed import job_key, max_restarts
from adloco.config import RUN_CONFIG_FILE, ConfigError, DataConfig, ModelConfig, RunConfig, resume_config
from adloco.data.sources import dataset_label
from adloco.metrics.tracking import check_trackers
from adloco.run.runs import RunLock, lock_run

JOBS_DIR = ".jobs"  # under run.root: one pointer file per torchrun job, naming the run directory it trains


@dataclass(frozen=True)
class RunIdentity:
    """What the run directory knows of the run it holds: where it lives (``run``), the stem of its default name,
    the text of its config.yaml, and, for an elastic run, the workers a restart may have resized it to."""

    run: RunConfig
    label: str
    config_yaml: str
    elastic_workers: int | None = None


def run_label(model: ModelConfig, data: DataConfig) -> str:
    """``<model>_<dataset>``: the stem of a run directory's default name."""
    return f"{model.preset or Path(str(model.path)).stem}_{dataset_label(data.dataset)}"


def make_run_dir(run: RunConfig, label: str) -> tuple[Path, bool]:
    """A new run directory; or (``run.name``) the one of that name when an earlier start of it left no checkpoint
    and no model, which is started over (the second value says so). One that holds work is refused."""
    root = Path(run.root)
    name = run.name or f"{label}_{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    path = root / name
    if run.name and path.exists():  # a second run there would leave `adloco eval` reading the first
        _check_reusable(path)
        return path, True
    suffix = 1
    while path.exists():  # two runs started in the same second
        suffix += 1
        path = root / f"{name}-{suffix}"
    try:
        path.mkdir(parents=True)
        (path / "checkpoints").mkdir()
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"run directory '{path}' cannot be created: {reason}") from None
    return path, False


def _check_reusable(path: Path) -> None:
    """ConfigError unless ``path`` is a run directory whose earlier start stopped before its first checkpoint."""
    if not (path / RUN_CONFIG_FILE).is_file():
        raise ConfigError(f"'{path}' already exists and is not a run directory; give another run.name")
    if list_checkpoints(path / "checkpoints") or (path / "final").exists():
        raise ConfigError(
            f"run directory '{path}' already exists; continue it with --resume {path}, or give another run.name"
        )


def _check_writable(directory: Path) -> None:
    """Preflight: a real probe file, since permission bits say nothing for root or on a read-only mount."""
    probe = directory / f".adloco-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"adloco")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"run directory '{directory}' is not writable: {error.strerror}") from None


class _RunLogHandler(logging.FileHandler):
    """train.log; a failed write (full disk) must not print a logging traceback in the middle of the run.

    The next checkpoint or metrics write reports the same problem as one line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


def attach_log_file(run_dir: Path) -> logging.Handler:
    try:
        handler = _RunLogHandler(run_dir / "train.log", encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot write '{run_dir / 'train.log'}': {error.strerror}") from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("adloco")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def _job_pointer(run: RunConfig) -> Path | None:
    """``<run.root>/.jobs/<job>``: where a torchrun job that may restart records its run directory."""
    key = job_key()
    return None if key is None else Path(run.root) / JOBS_DIR / key


def _record_job(run: RunConfig, run_dir: Path) -> None:
    pointer = _job_pointer(run)
    if pointer is None or max_restarts() == 0:
        return
    try:
        atomic_write_bytes(pointer, f"{run_dir.resolve()}\n".encode())
    except OSError as error:
        raise ConfigError(f"cannot record the run directory of this job in '{pointer}': {error.strerror}") from None


def restart_plan(identity: RunIdentity) -> tuple[str, str]:
    """On a restarted torchrun attempt (rank 0): what to do with the run directory the first attempt made.

    ("resume", dir) when it has a checkpoint, ("again", dir) when the first attempt died before its first
    checkpoint, ("new", "") when it died before creating a directory at all.
    """
    pointer = _job_pointer(identity.run)
    if pointer is None or not pointer.exists():
        return ("new", "")
    try:
        run_dir = Path(pointer.read_text().strip())
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"job pointer '{pointer}' cannot be read ({error})") from None
    if not (run_dir / RUN_CONFIG_FILE).exists():
        return ("new", "")
    started = resume_config(run_dir)
    if started.elastic and identity.elastic_workers is not None:  # a restart with another world size resizes the job
        started = started.model_copy(update={"workers": identity.elastic_workers})
    if started.to_yaml() != identity.config_yaml:
        # A pointer left by another job of the same id: never mix two configurations in one directory.
        raise ConfigError(f"run directory '{run_dir}' named by '{pointer}' was started with another configuration")
    return ("resume" if list_checkpoints(run_dir / "checkpoints") else "again", str(run_dir))


def clear_for_start_over(run_dir: Path) -> None:
    """Remove what a first attempt without any checkpoint left behind (train.log stays: it tells what happened)."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    for name in ("final", ".final.tmp", "plots"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)


def prepare_run_dir(identity: RunIdentity, resume: Path | None, again: Path | None = None) -> RunLock:
    """The run directory, locked for this process: a new one, or ``resume``/``again`` checked first."""
    if resume is not None:
        check_resumable(resume)
        lock = lock_run(resume)  # before anything in it changes
        try:
            _check_writable(resume / "checkpoints")
            _record_job(identity.run, resume)
        except BaseException:
            lock.release(None)
            raise
        return lock
    if again is not None:
        lock = lock_run(again)
        clear_for_start_over(again)
    else:
        path, reused = make_run_dir(identity.run, identity.label)
        lock = lock_run(path)
        if reused:  # after the lock: a live process starting it is refused, not cleared
            clear_for_start_over(path)
            lock.took_over = (lock.took_over + "; " if lock.took_over else "") + (
                f"'{path}' held no checkpoint from an earlier start; starting it over"
            )
    try:
        write_run_config(lock.run_dir, identity.config_yaml)
        _record_job(identity.run, lock.run_dir)
    except BaseException:
        lock.release(None)
        raise
    return lock


def write_run_config(run_dir: Path, config_yaml: str) -> None:
    """``config.yaml``, written whole or not at all."""
    try:
        atomic_write_bytes(run_dir / RUN_CONFIG_FILE, config_yaml.encode())
    except OSError as error:
        raise ConfigError(f"run directory '{run_dir}' is not writable: {error.strerror}") from None


def agree_on_restart(identity: RunIdentity, comm: Communicator) -> tuple[str, str]:
    """Rank 0's restart plan (see ``restart_plan``), on every rank; errors are every rank's errors."""
    plan: tuple[str, str] = ("new", "")
    if comm.rank == 0:
        try:
            plan = restart_plan(identity)
        except (ConfigError, CheckpointError) as error:
            plan = (type(error).__name__, str(error))
    plan = comm.broadcast_object(plan, src=0)
    if plan[0] in ("ConfigError", "CheckpointError"):
        raise (CheckpointError if plan[0] == "CheckpointError" else ConfigError)(plan[1])
    return plan


def claim_run_dir(
    identity: RunIdentity, resume: Path | None, again: Path | None, comm: Communicator
) -> tuple[RunLock | None, Path]:
    """Rank 0 makes or locks the run directory and tells every rank; an error there is every rank's error."""
    outcome: tuple[str, str] = ("ok", "")
    lock: RunLock | None = None
    if comm.rank == 0:
        try:
            check_trackers(identity.run.trackers)  # a missing tracker package stops the run before it starts
            lock = prepare_run_dir(identity, resume, again)
            outcome = ("ok", str(lock.run_dir))
        except (ConfigError, CheckpointError) as error:
            outcome = (type(error).__name__, str(error))
    outcome = comm.broadcast_object(outcome, src=0)
    if outcome[0] != "ok":
        raise (CheckpointError if outcome[0] == "CheckpointError" else ConfigError)(outcome[1])
    return lock, Path(outcome[1])


def newest_checkpoint(run_dir: Path) -> int | None:
    """The round of the newest checkpoint file in ``run_dir``, None if there is none."""
    found = list_checkpoints(run_dir / "checkpoints")
    return int(found[-1].stem.split("_")[1]) if found else None
