"""A Lightning fit made DiLoCo by one callback. Byte-level LLaMA on a text file (default: the bundled Tiny
Shakespeare); each torchrun rank is one worker:

    torchrun --nproc_per_node=2 examples/lightning_fit.py --steps 200
"""

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from adloco import end_process_group
from adloco.data.sources import bundled_text
from adloco.integrations.lightning import DiLoCoCallback, pl


class CausalLM(pl.LightningModule):
    def __init__(self, context: int) -> None:
        super().__init__()
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, max_position_embeddings=context)  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def main(args: argparse.Namespace) -> None:
    text = Path(args.data).read_bytes() if args.data else bundled_text("tinyshakespeare").encode()
    data = torch.tensor(list(text))
    split = len(data) * 9 // 10
    train = data[: split // args.context * args.context].view(-1, args.context)
    val = data[split : split + 64 * args.context].view(-1, args.context)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp", max_steps=args.steps,
        logger=False,
        callbacks=[DiLoCoCallback(sync_every=args.sync_every)],  # the one line: each optimizer step is an inner step
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = CausalLM(args.context)
    trainer.fit(module, DataLoader(train, batch_size=3, shuffle=True))
    (result,) = trainer.validate(module, DataLoader(val, batch_size=16), verbose=False)  # θ: set when fit ends
    if trainer.is_global_zero:
        print(f"diloco: val loss {result['val_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--data", default=None, help="a text file (default: the bundled Tiny Shakespeare)")
    main(parser.parse_args())
    end_process_group()  # after main returned: the trainer's cycles hold the process group
