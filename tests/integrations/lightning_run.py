"""A Lightning fit made DiLoCo, and the same training as a plain loop, under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 lightning_run.py OUT MODE [OUT MODE ...]

MODE is one of lightning, resume, loop; the runs one after another in one launch.

``lightning``: ``Trainer(strategy="ddp", callbacks=[DiLoCoCallback(...)]).fit`` over epochs of 5 steps, saving
Lightning's checkpoint at the end of the first (mid-round: rounds of 4); ``resume``: the same fit resumed from that
checkpoint (OUT names the first fit's files); ``loop``: a plain loop over the same module's ``training_step`` and
optimizer, each rank reading what Lightning's distributed sampler gives it epoch by epoch. Rank 0 writes θ by name
into OUT (OUT.resumed) and every rank its first parameter's sum after every inner step into OUT.rank<r>.
"""

import sys
from itertools import count

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from adloco import DiLoCo, end_process_group
from adloco.integrations.lightning import DiLoCoCallback, pl
from tests.integrations.hf_trainer_run import STEPS, SYNC_EVERY, Windows, tiny_llama

SAMPLES, EPOCH_STEPS = 20, 5  # 2 ranks × batches of 2: 5 steps an epoch, the first epoch's end mid-round


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
    data = Windows(SAMPLES)
    if mode in ("lightning", "resume"):
        callback = DiLoCoCallback(sync_every=SYNC_EVERY)
        saver = pl.callbacks.ModelCheckpoint(dirpath=f"{out}.ckpt", filename="{step}", save_top_k=-1,
                                             every_n_train_steps=EPOCH_STEPS)  # fmt: skip
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback, saver] if mode == "lightning" else [callback],
            enable_checkpointing=mode == "lightning",
        )  # fmt: skip
        resume = f"{out}.ckpt/step={EPOCH_STEPS}.ckpt" if mode == "resume" else None
        trainer.fit(module, DataLoader(data, batch_size=2), ckpt_path=resume)
        theta = callback.diloco.theta
    else:
        if not dist.is_initialized():  # a fit earlier in this launch made it
            dist.init_process_group("gloo")
        # what Lightning puts in a training loader under DDP: a shuffling distributed sampler, seed 0, epoch by epoch
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=2, sampler=sampler)
        optimizer = module.configure_optimizers()
        with DiLoCo(module, optimizer, sync_every=SYNC_EVERY) as diloco:
            for index, batch in zip(range(STEPS), _epochs(loader, sampler), strict=False):
                module.training_step(batch, index).backward()
                optimizer.step()
                optimizer.zero_grad()
                module.on_train_batch_end(None, batch, index)
        diloco.finish()
        theta = diloco.theta
    rank = dist.get_rank()
    if mode != "resume":
        torch.save(module.sums, f"{out}.rank{rank}")
    if rank == 0:
        names = [name for name, p in module.named_parameters() if p.requires_grad]
        saved = dict(zip(names, [t.detach().clone() for t in theta], strict=True))
        torch.save(saved, f"{out}.resumed" if mode == "resume" else out)
    dist.barrier()


def _epochs(loader: DataLoader, sampler: DistributedSampler):
    for epoch in count():
        sampler.set_epoch(epoch)
        yield from loader


if __name__ == "__main__":
    for out, mode in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
        main(out, mode)
    end_process_group()
