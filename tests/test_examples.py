"""The examples run as the README says, under torchrun with 2 ranks on CPU, on a tiny budget."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.test_replica import _lighthouse, needs_torchft
from tests.comm.test_distributed import _env, _free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _torchrun_example(name: str, *args: str, cwd: Path) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(EXAMPLES / name), *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.process
def test_the_plain_loop_example_trains_with_diloco(tmp_path):
    out = _torchrun_example("plain_loop.py", "--steps", "20", "--sync-every", "5", cwd=tmp_path)
    match = re.fullmatch(r"diloco: val loss (\d+\.\d+), ([\d,]+) tokens/s\n", out)
    assert match is not None, out
    assert 0 < float(match.group(1)) < 5.6  # below ln 256: it learned something in 20 steps


@pytest.mark.process
def test_the_hf_trainer_example_trains_with_diloco(tmp_path):
    out = _torchrun_example("hf_trainer.py", "--steps", "20", "--sync-every", "5", "--out", str(tmp_path / "o"),
                            cwd=tmp_path)  # fmt: skip
    loss = re.search(r"^diloco: val loss (\d+\.\d+)$", out, re.M)
    assert loss is not None and 0 < float(loss.group(1)) < 5.6, out[-2000:]


@pytest.mark.process
def test_the_lightning_example_trains_with_diloco(tmp_path):
    out = _torchrun_example("lightning_fit.py", "--steps", "20", "--sync-every", "5", cwd=tmp_path)
    loss = re.search(r"^diloco: val loss (\d+\.\d+)$", out, re.M)
    assert loss is not None and 0 < float(loss.group(1)) < 5.6, out[-2000:]


@pytest.mark.process
def test_the_adaptive_loop_example_trains_with_adloco(tmp_path):
    out = _torchrun_example("adaptive_loop.py", "--tokens", "6144", "--sync-every", "4", "--batch", "2",
                            "--controller", "test", cwd=tmp_path)  # fmt: skip
    match = re.fullmatch(r"adloco: val loss (\d+\.\d+), ([\d,]+) tokens/s, b 2 -> (\d+)\n", out)
    assert match is not None, out
    assert 0 < float(match.group(1)) < 5.6 and int(match.group(3)) >= 2  # b never shrinks by default


@pytest.mark.process
@needs_torchft
def test_the_replica_example_trains_as_fault_tolerant_replicas(tmp_path):
    lighthouse, address = _lighthouse(min_replicas=2)
    try:
        command = [sys.executable, str(EXAMPLES / "replica_loop.py"), "--replicas", "2", "--lighthouse", address,
                   "--host", "127.0.0.1", "--steps", "20", "--sync-every", "5"]  # fmt: skip
        procs = [subprocess.Popen([*command, "--replica", str(r), "--log", str(tmp_path / f"r{r}.jsonl")], cwd=tmp_path,
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]  # fmt: skip
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    losses = [re.search(r"val loss (\d+\.\d+) after 20 steps", out).group(1) for out, _ in outputs]
    assert losses[0] == losses[1] and 0 < float(losses[0]) < 5.6  # the same θ, and it learned
    assert len((tmp_path / "r0.jsonl").read_text().splitlines()) == 4  # a line per round of 5 steps
