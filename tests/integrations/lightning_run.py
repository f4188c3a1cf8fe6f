"""A Lightning fit made DiLoCo, and the same training as a plain loop, under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 lightning_run.py OUT lightning|loop

``lightning``: ``Trainer(strategy="ddp", callbacks=[DiLoCoCallback(...)]).fit``; ``loop``: a plain loop over the same
module's ``training_step`` and optimizer, each rank reading what Lightning's distributed sampler gives it. Rank 0
writes θ by name into OUT and every rank its first parameter's sum after every inner step into OUT.rank<r>.
"""

import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from adloco import DiLoCo, end_process_group
from adloco.integrations.lightning import DiLoCoCallback, pl
from tests.integrations.hf_trainer_run import STEPS, SYNC_EVERY, Windows, tiny_llama


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.sums: list[float] = []

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs, batch, index) -> None:
        self.sums.append(float(next(self.model.parameters()).detach().sum()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(out: str, mode: str) -> None:
    torch.manual_seed(0)
    module = Module()
    data = Windows(64)
    if mode == "lightning":
        callback = DiLoCoCallback(sync_every=SYNC_EVERY)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, callbacks=[callback], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(data, batch_size=2))
        theta = callback.diloco.theta
    else:
        dist.init_process_group("gloo")
        # what Lightning puts in a training loader under DDP: a shuffling distributed sampler, seed 0, epoch 0
        loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True, seed=0))
        optimizer = module.configure_optimizers()
        with DiLoCo(module, optimizer, sync_every=SYNC_EVERY) as diloco:
            for index, batch in zip(range(STEPS), loader, strict=False):
                module.training_step(batch, index).backward()
                optimizer.step()
                optimizer.zero_grad()
                module.on_train_batch_end(None, batch, index)
        diloco.finish()
        theta = diloco.theta
    rank = dist.get_rank()
    torch.save(module.sums, f"{out}.rank{rank}")
    if rank == 0:
        names = [name for name, p in module.named_parameters() if p.requires_grad]
        torch.save(dict(zip(names, [t.detach().clone() for t in theta], strict=True)), out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_process_group()
