"""A plain PyTorch training loop made DiLoCo by one `with`. Byte-level LLaMA on a text file (default: the
bundled Tiny Shakespeare); each rank is one worker:

    torchrun --nproc_per_node=2 examples/plain_loop.py --steps 400        # DiLoCo, H = 10
    torchrun --nproc_per_node=2 examples/plain_loop.py --steps 400 --ddp  # the same loop under torch DDP
"""

import argparse
import contextlib
import os
import time
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from adloco import DiLoCo, end_process_group
from adloco.data.sources import bundled_text


def windows(data: torch.Tensor, batch: int, context: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context, (batch,), generator=generator).tolist()
        yield torch.stack([data[s : s + context] for s in starts])


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text = Path(args.data).read_bytes() if args.data else bundled_text("tinyshakespeare").encode()
    data = torch.tensor(list(text))
    train, val = data[: len(data) * 9 // 10], data[len(data) * 9 // 10 :]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, max_position_embeddings=args.context)  # fmt: skip
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # one GPU per rank, shared when there are fewer GPUs
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    forward = DistributedDataParallel(model) if args.ddp else model
    sync = contextlib.nullcontext() if args.ddp else DiLoCo(model, optimizer, sync_every=args.sync_every)
    started = time.perf_counter()
    with sync:
        for batch in islice(windows(train, args.batch, args.context, seed=rank), args.steps):
            batch = batch.to(device)
            forward(input_ids=batch, labels=batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    seconds = time.perf_counter() - started
    if isinstance(sync, DiLoCo):
        sync.finish()  # the model is now θ, the model DiLoCo trained
    with torch.no_grad():
        val_batch = torch.stack([val[s : s + args.context] for s in range(0, 64 * args.context, args.context)])
        val_batch = val_batch.to(device)
        loss = model(input_ids=val_batch, labels=val_batch).loss.item()
    if rank == 0:
        tokens = args.steps * args.batch * args.context * world
        print(f"{'ddp' if args.ddp else 'diloco'}: val loss {loss:.4f}, {tokens / seconds:,.0f} tokens/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--ddp", action="store_true", help="torch DDP instead of DiLoCo, for comparison")
    parser.add_argument("--data", default=None, help="a text file (default: the bundled Tiny Shakespeare)")
    parser.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda); the exchange is gloo")
    main(parser.parse_args())
    end_process_group()  # after main returned: the optimizer hooks' cycles hold the process group
