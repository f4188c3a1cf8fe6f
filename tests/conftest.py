import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adloco.checkpoint import list_checkpoints

# Tests never reach the hub: `datasets` and `transformers` read these when first imported, and this file is
# imported before any test module; the dataset cache stays out of the user's home.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(tempfile.gettempdir(), "adloco-test-datasets-cache"))
# Two test processes (pytest-xdist) share the cores: one torch thread each, and in the processes their tests start.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

# A run small enough for the test suite: tiny LLaMA at context 16, two workers, a few rounds.
# The time-aware controller's costs, pinned: its decisions then follow the statistics only and reproduce exactly
# (in one process and across ranks, before and after a resume); the budget bound is relaxed for tiny budgets.
PINNED_PACE = ["batch.time.step_seconds=[0.01,0.001]", "batch.time.round_seconds=0.05", "batch.time.min_steps_left=1"]

FAST = [
    "model.context=16",
    "workers=2",
    "batch.size=2",
    "sync_every=4",
    "total_tokens=1024",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "run.progress=false",
    "run.plots=false",
]


# The unit tier (pytest -m unit, under a minute on 2 cores): the tests of the packages below the workers, less
# those marked as training a run or starting processes. A unit test that starts a process fails (mark it process).
UNIT_PACKAGES = ("algorithms", "config", "batch", "sync")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    if "stress" not in (config.getoption("markexpr") or ""):  # a tier's -m leaves the stress scenarios out too
        stress = [item for item in items if item.get_closest_marker("stress")]
        if stress:
            config.hook.pytest_deselected(items=stress)
            items[:] = [item for item in items if not item.get_closest_marker("stress")]
    for item in items:
        if item.get_closest_marker("stress"):  # their faults are timed in seconds: one scenario at a time
            item.add_marker(pytest.mark.xdist_group("stress"))
        parts = Path(item.fspath).resolve().relative_to(tests).parts
        heavy = item.get_closest_marker("training") or item.get_closest_marker("process")
        if len(parts) > 1 and parts[0] in UNIT_PACKAGES and not heavy:
            item.add_marker(pytest.mark.unit)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Under pytest-xdist's loadgroup a test marked xdist_group reaches the scheduler as "<id>@<group>". pytest 9.2
    # reads a test's id from a new field, so pytest-xdist 3.8's suffix has no effect and groups are silently
    # ignored: the stress scenarios would run side by side, a launch shared by a module's tests once per process.
    grouping = "PYTEST_XDIST_WORKER" in os.environ and item.config.getvalue("loadgroup")
    if grouping and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail(
            f"pytest-xdist did not keep this test's xdist_group (pytest {pytest.__version__}, pytest-xdist "
            f"{version('pytest-xdist')}): install the dev extras' pytest",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is in the unit tier but starts a process: mark it process")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture
def fast_overrides(tmp_path):
    return [*FAST, f"run.root={tmp_path / 'runs'}"]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported parameters of a finished run."""
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def adloco_process(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m adloco ARGS`` in a process of its own, as a user at a shell runs it; the ``key=value`` items are
    laid over each other as a script building its command line would (``layered``)."""
    from adloco.config.input import layered

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "adloco", *layered(list(args))]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of two parameter dicts."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cut_back(run_dir: Path, dest: Path, keep: int) -> Path:
    """A copy of a finished run as a crash would have left it: no export, only its first ``keep`` checkpoints."""
    shutil.copytree(run_dir, dest)
    shutil.rmtree(dest / "final")
    for path in list_checkpoints(dest / "checkpoints")[keep:]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()  # a sharded checkpoint is a folder
    return dest


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree
