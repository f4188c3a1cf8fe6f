"""AdLoCo in a plain PyTorch loop: DiLoCo whose batch adapts, measured from the loop's own loss. Byte-level
LLaMA on a text file (default: the bundled Tiny Shakespeare); each rank is one worker:

    torchrun --nproc_per_node=2 examples/adaptive_loop.py --tokens 153600
    torchrun --nproc_per_node=2 examples/adaptive_loop.py --tokens 153600 --controller test  # the norm test's b
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from adloco import DiLoCo, end_process_group
from adloco.data.sources import bundled_text


class Windows(Dataset):
    """Every ``context`` bytes of the text, as one sample."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) // self.context

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index * self.context : (index + 1) * self.context]


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text = Path(args.data).read_bytes() if args.data else bundled_text("tinyshakespeare").encode()
    data = torch.tensor(list(text))
    train, val = data[: len(data) * 9 // 10], data[len(data) * 9 // 10 :]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, max_position_embeddings=args.context)  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batch = {"size": args.batch, "controller": args.controller}  # the config's batch section
    diloco = DiLoCo(model, optimizer, sync_every=args.sync_every, method="adloco", batch=batch,
                    total_samples=args.tokens // args.context)  # fmt: skip
    dataset = Windows(train, args.context)
    loader = DataLoader(dataset, batch_sampler=diloco.batch.sampler(len(dataset), seed=rank))  # b as it adapts
    read, started = 0, time.perf_counter()
    with diloco:
        for batch in loader:
            if read >= args.tokens:
                break
            diloco.batch.backward(lambda x: model(input_ids=x, labels=x).loss, batch)  # groups on a statistics step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # the batch's lr factor applies here
            optimizer.zero_grad()
            read += batch.numel() * world  # every rank reads as many samples
    seconds = time.perf_counter() - started
    diloco.finish()  # the model is now θ
    with torch.no_grad():
        val_batch = torch.stack([val[s : s + args.context] for s in range(0, 64 * args.context, args.context)])
        loss = model(input_ids=val_batch, labels=val_batch).loss.item()
    if rank == 0:
        print(f"adloco: val loss {loss:.4f}, {read / seconds:,.0f} tokens/s, b {args.batch} -> {diloco.batch.size}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=153_600, help="the token budget over all ranks")
    parser.add_argument("--batch", type=int, default=3, help="the batch each worker starts with")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument(
        "--controller",
        default="time",
        choices=["time", "test"],
        help="b from the fastest batch by the measured costs (time) or as the norm test asks (test)",
    )
    parser.add_argument("--data", default=None, help="a text file (default: the bundled Tiny Shakespeare)")
    main(parser.parse_args())
    end_process_group()  # after main returned: the optimizer hooks' cycles hold the process group
