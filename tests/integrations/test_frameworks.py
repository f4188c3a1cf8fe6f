"""The HF Trainer and Lightning made DiLoCo by adloco's integrations, under torchrun with 2 ranks: each equals, bit
for bit, a plain loop with adloco.DiLoCo over the framework's own data order, optimizer, schedule and loss, and its
ranks drift apart within a round (no per-step gradient all-reduce left) and agree at every round's end. A run
resumed from the framework's own mid-round checkpoint ends on the same bits. As fault-tolerant replicas (plain
processes, an ``adloco lighthouse`` between them) a killed one started again heals and follows the job's step."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.api.test_replica import DEADLINE_S, _finish, _lighthouse, needs_torchft
from tests.comm.test_distributed import _env, _free_port
from tests.integrations import replica_run

HERE = Path(__file__).resolve().parent
SYNC_EVERY = 4


def _launch(script: str, *runs: tuple[Path, str]) -> None:
    """The runs (OUT, MODE) of ``script`` one after another in one launch of two ranks."""
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parents[1]), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(HERE / script)]  # fmt: skip
    command += [item for out, mode in runs for item in (str(out), mode)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=runs[0][0].parent, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.process
@pytest.mark.parametrize(("script", "framework"), [("hf_trainer_run.py", "trainer"), ("lightning_run.py", "lightning")])
def test_a_framework_run_is_diloco_and_equals_the_plain_loop(tmp_path, script, framework):
    _launch(script, *[(tmp_path / f"{mode}.pt", mode) for mode in (framework, "loop")])
    got, plain = torch.load(tmp_path / f"{framework}.pt"), torch.load(tmp_path / "loop.pt")
    assert _same(got, plain)
    # the framework's own checkpoint mid-round (the Trainer's after step 6, Lightning's at the end of the first
    # epoch, step 5), resumed in a new launch
    _launch(script, (tmp_path / f"{framework}.pt", "resume"))
    assert _same(got, torch.load(tmp_path / f"{framework}.pt.resumed"))
    first, second = (torch.load(tmp_path / f"{framework}.pt.rank{r}") for r in (0, 1))
    for step, (a, b) in enumerate(zip(first, second, strict=True), start=1):
        assert (a == b) == (step % SYNC_EVERY == 0), (step, a, b)  # apart within a round, θ at its end


def test_a_lightning_fit_resumed_from_a_checkpoint_without_diloco_state_is_refused(tmp_path):
    from torch.utils.data import DataLoader

    from adloco.integrations.lightning import DiLoCoCallback, pl
    from tests.integrations.lightning_run import Module, Windows

    def fit(callbacks, steps, **options):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks)  # fmt: skip
        trainer.fit(Module(), DataLoader(Windows(4), batch_size=2), **options)
        return trainer

    plain = fit([], 2)  # Lightning's own checkpoint, no DiLoCo in it
    saved = next(tmp_path.rglob("*.ckpt"))
    assert plain.global_step == 2
    with pytest.raises(ValueError, match="resuming at step 2 from a checkpoint without DiLoCo's state"):
        fit([DiLoCoCallback(sync_every=2)], 4, ckpt_path=saved)


@pytest.mark.parametrize("framework", ["Trainer", "Lightning"])
def test_a_framework_replica_is_one_plain_process(framework):
    from adloco.integrations.replicas import check_replica_launch

    ft = {"fault_tolerance": {"lighthouse": "http://127.0.0.1:1", "replica": 0, "replicas": 2}}
    with pytest.raises(ValueError, match=f"the {framework} runs 2: start each replica as a plain process"):
        check_replica_launch(ft, 2, framework)
    check_replica_launch(ft, 1, framework)
    check_replica_launch({"fault_tolerance": None}, 2, framework)  # not a replica: torchrun


@pytest.mark.process
@needs_torchft
def test_framework_replicas_killed_mid_round_heal_and_follow_the_jobs_step_and_schedule(tmp_path):
    """Three replicas of one job: replica 0 an HF Trainer that survives; replica 1 a Lightning fit and replica 2 a
    Trainer, each SIGKILLed mid-round and started again (the Trainer resumed from its last checkpoint). A
    restarted one heals from a peer, its framework's step and learning-rate schedule move to the peers' step, it
    ends with them (max_steps) and on their θ, bit for bit; and in both lives it reads at each step the windows a
    replica that never stopped reads there (its framework's order, epoch by epoch): none twice."""
    deadline = time.monotonic() + DEADLINE_S
    frameworks = {0: "hf", 1: "lightning", 2: "hf"}
    slow = ["--step-seconds", "0.15"]
    lighthouse, address = _lighthouse(min_replicas=1)
    try:
        survivor = _framework_replica(tmp_path, 0, frameworks[0], address, *slow)
        kept = {1: [], 2: ["--checkpoints"]}
        doomed = [_framework_replica(tmp_path, r, frameworks[r], address, "--die-after", "6", *slow, *kept[r])
                  for r in (1, 2)]  # fmt: skip
        assert _finish(doomed, deadline) == [-9, -9]
        resume = {1: [], 2: ["--resume"]}  # the Trainer from its last checkpoint; the peers are further on
        back = [_framework_replica(tmp_path, r, frameworks[r], address, *slow, *kept[r], *resume[r]) for r in (1, 2)]
        assert _finish([survivor, *back], deadline) == [0, 0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    results = {r: json.loads((tmp_path / f"replica{r}.json").read_text()) for r in range(3)}
    steps, sync_every = replica_run.STEPS, replica_run.SYNC_EVERY
    assert all(result["steps"] == steps for result in results.values())
    assert any(h["absent"] for h in results[0]["history"])  # the survivor went on without the dead
    for r in (1, 2):
        framework_step, diloco_step = results[r]["start"]
        assert framework_step == diloco_step and diloco_step > 6 and diloco_step % sync_every == 0
        assert results[r]["history"][0]["healed"]
        assert _theta_same(torch.load(tmp_path / f"replica{r}.pt"), torch.load(tmp_path / "replica0.pt"))
    # the Trainer resumed at its last checkpoint (a multiple of H before it died), then healed from the peers
    assert 0 < results[2]["resumed_at"] < results[2]["start"][1] and results[2]["resumed_at"] % sync_every == 0
    assert results[2]["lr"] == results[0]["lr"]  # the Trainer's linear schedule, at max_steps on both
    assert results[2]["epoch"] == results[0]["epoch"]  # and its epoch: the job's, not counted from its loop's start
    assert results[1]["lr"] == pytest.approx(replica_run.LR * (1 - steps / (2 * steps)))  # Lightning's, at its end
    for r in (1, 2):  # each step's windows (Lightning: its 2 batches), both lives: none read twice, the right ones
        by_step: dict[int, list[int]] = {}
        for line in (tmp_path / f"reads{r}.jsonl").read_text().splitlines():
            read = json.loads(line)
            by_step.setdefault(read["step"], []).extend(read["windows"])
        taken = list(by_step)
        assert taken == sorted(taken) and taken[-1] == steps
        assert results[r]["start"][1] + 1 in taken[1:]  # its second life went on from the job's step
        assert all(windows == results[r]["expected"][step - 1] for step, windows in by_step.items())


def _framework_replica(out: Path, replica: int, framework: str, lighthouse: str, *flags: str) -> subprocess.Popen:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parents[1]), env.get("PYTHONPATH")) if p)
    env["RUST_LOG"] = "error"
    command = [sys.executable, str(HERE / "replica_run.py"), str(out), framework, "--replica", str(replica)]
    command += ["--lighthouse", lighthouse, *flags]
    return subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _theta_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
