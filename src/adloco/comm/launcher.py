"""What the launcher says about this process, read from its environment without importing torch: whether torchrun
started it, the world size, how often the job has been restarted, and a name every attempt of the job shares."""

from __future__ import annotations

import os
import re


def launched_by_torchrun() -> bool:
    """True under torchrun, or when RANK and WORLD_SIZE are set by hand."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _int_env(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


def world_size_from_env() -> int:
    """The world size torchrun set for this job (1 without torchrun), read before any process group exists."""
    return max(1, _int_env("WORLD_SIZE")) if launched_by_torchrun() else 1


def restart_attempt() -> int:
    """How often torchrun has restarted this job's workers so far (0: the first attempt, or no torchrun)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT")


def max_restarts() -> int:
    """torchrun's ``--max-restarts`` for this job (0 without torchrun)."""
    return _int_env("TORCHELASTIC_MAX_RESTARTS")


def job_key() -> str | None:
    """A file-name-safe name of this torchrun job that every attempt of the job shares; None without torchrun.

    torchrun keeps ``TORCHELASTIC_RUN_ID`` across restarts (``--rdzv-id``; a fresh UUID with ``--standalone``).
    Its default is the literal ``none``; master address and port, also fixed for the job, tell such jobs apart.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id in ("", "none"):
        run_id = f"none_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)
