"""One fault-tolerant replica trained by a framework: an HF ``Trainer`` or a Lightning fit, in a plain process.

    python replica_run.py OUT hf|lightning --replica I --lighthouse ADDR [--die-after N] [--step-seconds T]
        [--checkpoints [--resume]]

Replica I reads its own shard of the windows. ``--die-after N`` SIGKILLs the process after it took N optimizer
steps (mid-round when N is not a multiple of H); ``--step-seconds`` makes each step take that much longer, so the
others are still training when a killed replica comes back; ``--checkpoints`` has the Trainer save every H steps
and ``--resume`` resumes it from its last checkpoint. At the end it writes θ (``OUT/replica<I>.pt``) and
``OUT/replica<I>.json``: the framework's step when training began and at the end (after a heal, the peers'),
DiLoCo's step when training began, the last learning rate (and the Trainer's epoch), the rounds' records, and
the windows a replica that never stopped reads at each step (its framework's own data order, epoch by epoch).
Every step it trains, each life of the replica appends the step and the windows it read to ``OUT/reads<I>.jsonl``.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

from adloco.integrations.hf import use_diloco
from tests.integrations.hf_trainer_run import Windows, tiny_llama

STEPS, SYNC_EVERY, REPLICAS, LR = 120, 4, 3, 1e-3
# a replica's windows: 13 batches of 2 an epoch, so a heal at a round's start (a multiple of H = 4 steps) lands past
# the first epoch and within an epoch but at steps 52 and 104 (the Trainer: 13 steps an epoch) or 28, 56, 84 and 112
# (Lightning, accumulating 2 batches a step: 7 steps an epoch, the last of one batch)
WINDOWS, ACCUMULATE = 26, 2


class Shard(torch.utils.data.Dataset):
    """Replica ``replica``'s windows: every REPLICAS-th one of the corpus."""

    def __init__(self, replica: int) -> None:
        self.rows = Windows(WINDOWS * REPLICAS).rows[replica::REPLICAS]
        self.index = {tuple(row.tolist()): i for i, row in enumerate(self.rows)}

    def indices(self, input_ids: torch.Tensor) -> list[int]:
        return [self.index[tuple(row.tolist())] for row in input_ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class Reads:
    """Appends each step a replica trains and the windows it read to ``reads<I>.jsonl`` (kept when it is killed)."""

    def __init__(self, out: Path, replica: int) -> None:
        self.path, self.shard = out / f"reads{replica}.jsonl", Shard(replica)

    def record(self, step: int, input_ids: torch.Tensor) -> None:  # each batch: a step's (or a part of it)
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, "windows": self.shard.indices(input_ids)}) + "\n")


def _by_step(loader: torch.utils.data.DataLoader, shard: Shard, set_epoch, accumulate: int = 1) -> list[list[int]]:
    """The windows of each step of STEPS, epoch after epoch, each epoch's order set as its framework sets it, and
    ``accumulate`` batches to a step (an epoch's last step takes those left)."""
    steps: list[list[int]] = []
    for epoch in range(-(-STEPS // -(-len(loader) // accumulate))):
        set_epoch(epoch)
        batches = [shard.indices(batch["input_ids"]) for batch in loader]
        steps += [sum(batches[i : i + accumulate], []) for i in range(0, len(batches), accumulate)]
    return steps[:STEPS]


class Fate:
    """The steps a replica takes: each made ``seconds`` longer, and the process killed after ``die_after``."""

    def __init__(self, die_after: int | None, seconds: float) -> None:
        self.die_after, self.seconds, self.taken = die_after, seconds, 0

    def step(self) -> None:
        self.taken += 1
        if self.taken == self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.seconds)


def run_hf(replica: int, ft: dict, fate: Fate, out: Path, checkpoints: bool = False, resume: bool = False) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Resumed(TrainerCallback):  # before DiLoCo's: the step the Trainer resumed at, before a heal moves it
        def on_train_begin(self, args, state, control, **kwargs) -> None:
            self.at = state.global_step

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs) -> None:
            self.start = (state.global_step, callback.diloco.inner_step)

        def on_step_end(self, args, state, control, **kwargs) -> None:
            fate.step()

    args = TrainingArguments(
        output_dir=str(out / f"hf{replica}"), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
        use_cpu=True, report_to=[], logging_strategy="no", save_strategy="steps" if checkpoints else "no",
        save_steps=SYNC_EVERY, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    reads = Reads(out, replica)

    class Recording(Trainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            reads.record(self.state.global_step + 1, inputs["input_ids"])
            return super().training_step(model, inputs, *rest, **kwargs)

    resumed = Resumed()
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=Shard(replica), callbacks=[resumed])
    callback = use_diloco(trainer, sync_every=SYNC_EVERY, fault_tolerance=ft)
    watch = Watch()
    trainer.add_callback(watch)  # after DiLoCo's: it sees the Trainer's step once a heal moved it
    trainer.train(resume_from_checkpoint=True if resume else None)
    lr = trainer.lr_scheduler.get_last_lr()[0]
    result = _result(trainer.model, callback.diloco, watch.start, trainer.state.global_step, lr)
    fresh = trainer.get_train_dataloader()  # the Trainer's own data order, seeded and set epoch by epoch
    expected = _by_step(fresh, reads.shard, fresh.set_epoch)
    return {**result, "resumed_at": resumed.at, "epoch": trainer.state.epoch, "expected": expected}


def run_lightning(replica: int, ft: dict, fate: Fate, out: Path) -> dict:
    from torch.utils.data import DataLoader, DistributedSampler

    from adloco.integrations.lightning import DiLoCoCallback, pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch: dict, index: int) -> torch.Tensor:
            reads.record(self.trainer.global_step + 1, batch["input_ids"])
            return self.model(**batch).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
            decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (2 * STEPS))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.start = (trainer.global_step, callback.diloco.inner_step)
            self.step = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, index) -> None:
            if trainer.global_step != self.step:  # an optimizer step ended with this batch
                self.step = trainer.global_step
                fate.step()

    reads = Reads(out, replica)
    callback, watch = DiLoCoCallback(sync_every=SYNC_EVERY, fault_tolerance=ft), Watch()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, enable_checkpointing=False,
                         accumulate_grad_batches=ACCUMULATE, callbacks=[callback, watch], **quiet)  # fmt: skip
    module = Module()

    def loader() -> DataLoader:  # an order drawn from the epoch: one a replica started again can follow
        return DataLoader(reads.shard, batch_size=2, sampler=DistributedSampler(reads.shard, 1, 0, seed=0))

    trainer.fit(module, loader())
    lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    result = _result(module.model, callback.diloco, watch.start, trainer.global_step, lr)
    fresh = loader()
    return {**result, "expected": _by_step(fresh, reads.shard, fresh.sampler.set_epoch, ACCUMULATE)}


def _result(model: torch.nn.Module, diloco, start: tuple[int, int], steps: int, lr: float) -> dict:
    theta = [p.detach().clone() for p in model.parameters()]
    history = [vars(record) for record in diloco.replica.history]
    return {"theta": theta, "start": list(start), "steps": steps, "lr": lr, "history": history}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("framework", choices=["hf", "lightning"])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--checkpoints", action="store_true", help="hf: save a checkpoint every H steps")
    parser.add_argument("--resume", action="store_true", help="hf: resume from the last checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ft = {"lighthouse": args.lighthouse, "replica": args.replica, "replicas": REPLICAS, "host": "127.0.0.1",
          "exchange_timeout_s": 20.0, "quorum_timeout_s": 60.0}  # fmt: skip
    out, fate = Path(args.out), Fate(args.die_after, args.step_seconds)
    if args.framework == "hf":
        result = run_hf(args.replica, ft, fate, out, args.checkpoints, args.resume)
    else:
        result = run_lightning(args.replica, ft, fate, out)
    torch.save(result.pop("theta"), out / f"replica{args.replica}.pt")
    (out / f"replica{args.replica}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
