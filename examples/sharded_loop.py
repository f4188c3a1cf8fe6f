"""DiLoCo across workers that each span several ranks: every worker's model sharded with FSDP2 over `--shards`
ranks (a 2-D mesh: workers × shards), the rounds' exchange over the other dimension. Byte-level LLaMA:

    torchrun --nproc_per_node=4 examples/sharded_loop.py --shards 2   # 2 workers of 2 ranks each
"""

import argparse
import math
import resource
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from adloco import DiLoCo, end_process_group
from adloco.data.sources import bundled_text


def build_model(context: int, hidden: int = 128, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, max_position_embeddings=context)  # fmt: skip
    return LlamaForCausalLM(config)


def shard(model: LlamaForCausalLM, mesh: DeviceMesh) -> LlamaForCausalLM:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def windows(data: torch.Tensor, batch: int, context: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context, (batch,), generator=generator).tolist()
        yield torch.stack([data[s : s + context] for s in starts])


def train(model, optimizer, batches, diloco: DiLoCo, part=lambda batch: batch) -> None:
    """The loop: each step this rank's ``part`` of its worker's batch; FSDP averages the parts' gradients."""
    with diloco:
        for batch in batches:
            mine = part(batch)
            model(input_ids=mine, labels=mine).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm of the worker's whole gradient
            optimizer.step()
            optimizer.zero_grad()
    diloco.finish()  # every shard of every worker now holds its rows of θ


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // args.shards, args.shards),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip
    worker, index = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    text = Path(args.data).read_bytes() if args.data else bundled_text("tinyshakespeare").encode()
    data = torch.tensor(list(text))
    model = shard(build_model(args.context, args.hidden, args.layers), mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=args.sync_every, process_group=mesh["replicate"])
    batches = islice(windows(data, args.batch, args.context, seed=worker), args.steps)  # one stream per worker
    train(model, optimizer, batches, diloco, part=lambda batch: batch.chunk(args.shards)[index])
    with torch.no_grad():  # every rank takes part: the forward gathers the shards
        held_out = torch.stack([data[-(s + 1) * args.context :][: args.context] for s in range(32)])
        loss = model(input_ids=held_out, labels=held_out).loss.item()
    # what a rank sent per round and its peak resident memory, the largest over the ranks
    per_rank = torch.tensor([diloco.comm.stats.wire_bytes / math.ceil(args.steps / args.sync_every),
                             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # fmt: skip
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"diloco, {mesh.size(0)} workers of {args.shards} ranks: loss {loss:.4f}; per rank {per_rank[0]:,.0f} "
              f"bytes a round, peak memory {per_rank[1]:,.0f} MB")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2, help="ranks per worker")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="samples per worker per step (split over its ranks)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128, help="the model's width")
    parser.add_argument("--layers", type=int, default=4, help="the model's decoder layers")
    parser.add_argument("--data", default=None, help="a text file (default: the bundled Tiny Shakespeare)")
    main(parser.parse_args())
    end_process_group()
