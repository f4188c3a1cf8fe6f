"""The HF Trainer and Lightning made DiLoCo by adloco's integrations, under torchrun with 2 ranks: each equals, bit
for bit, a plain loop with adloco.DiLoCo over the framework's own data order, optimizer, schedule and loss, and its
ranks drift apart within a round (no per-step gradient all-reduce left) and agree at every round's end. A run
resumed from the framework's own mid-round checkpoint ends on the same bits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.comm.test_distributed import _env, _free_port

HERE = Path(__file__).resolve().parent
SYNC_EVERY = 4


def _launch(script: str, out: Path, mode: str) -> None:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parents[1]), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(HERE / script), str(out), mode]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=out.parent, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("script", "framework"), [("hf_trainer_run.py", "trainer"), ("lightning_run.py", "lightning")])
def test_a_framework_run_is_diloco_and_equals_the_plain_loop(tmp_path, script, framework):
    for mode in (framework, "loop"):
        _launch(script, tmp_path / f"{mode}.pt", mode)
    got, plain = torch.load(tmp_path / f"{framework}.pt"), torch.load(tmp_path / "loop.pt")
    assert _same(got, plain)
    # the framework's own checkpoint mid-round (the Trainer's after step 6, Lightning's at the end of the first
    # epoch, step 5), resumed in a new launch
    _launch(script, tmp_path / f"{framework}.pt", "resume")
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


def test_fault_tolerant_replicas_are_refused_by_the_frameworks_for_now(tmp_path):
    from adloco.integrations.lightning import DiLoCoCallback

    ft = {"lighthouse": "http://127.0.0.1:1", "replica": 0, "replicas": 2}
    with pytest.raises(ValueError, match="a loop of your own"):
        DiLoCoCallback(sync_every=4, fault_tolerance=ft)
    from transformers import Trainer, TrainingArguments

    from adloco.integrations.hf import use_diloco

    trainer = Trainer(model=torch.nn.Linear(2, 1), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    with pytest.raises(ValueError, match="a loop of your own"):
        use_diloco(trainer, sync_every=4, fault_tolerance=ft)
