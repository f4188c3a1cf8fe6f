"""One fault-tolerant replica of a DiLoCo job (torchft): the loop of plain_loop.py, started and stopped on its own.

    adloco lighthouse --min-replicas 2 &
    python examples/replica_loop.py --replica 0 --replicas 3 --lighthouse http://localhost:29510 &
    python examples/replica_loop.py --replica 1 --replicas 3 --lighthouse http://localhost:29510 &
    python examples/replica_loop.py --replica 2 --replicas 3 --lighthouse http://localhost:29510

On GPUs add ``--device cuda:N`` (and ``--backend gloo`` where replicas share a GPU or the machines have no NCCL
network between them). Kill any replica (kill -9) and the others go on without it; start it again with the same
command and it heals from one of them at the next round and goes on from their step. The tiny byte-level LLaMA
on Tiny Shakespeare; worker i's batch at inner step s is drawn from a generator seeded by (i, s), so a replica
that comes back reads the windows of the steps it takes, none twice. ``--log FILE`` appends one JSON line per
round (who took part, who was absent, whether it committed, whether this replica healed there).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adloco import DiLoCo
from adloco.data.sources import bundled_text


def window(data: torch.Tensor, replica: int, step: int, batch: int, context: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * replica + step)
    starts = torch.randint(0, len(data) - context, (batch,), generator=generator).tolist()
    return torch.stack([data[s : s + context] for s in starts])


def log_rounds(diloco: DiLoCo, path: Path | None, written: int, joining: float, last: bool = False) -> int:
    """Append the rounds whose exchange is over (all but the one in progress, or all of them at the end)."""
    history = diloco.replica.history
    done = len(history) if last else len(history) - 1
    if path is not None and done > written:
        with path.open("a") as out:
            for record in history[written:done]:
                out.write(json.dumps({**vars(record), "joining": joining}) + "\n")
    return max(written, done)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    data = torch.tensor(list(bundled_text("tinyshakespeare").encode()))
    train, val = data[: len(data) * 9 // 10], data[len(data) * 9 // 10 :]
    torch.manual_seed(0)  # every replica builds the same model; at the start they all take replica 0's θ anyway
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, max_position_embeddings=args.context)  # fmt: skip
    model = LlamaForCausalLM(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    fault_tolerance = {"lighthouse": args.lighthouse, "replica": args.replica, "replicas": args.replicas,
                       "min_replicas": args.min_replicas, "host": args.host, "backend": args.backend}  # fmt: skip
    joining = time.time()  # imports and the model are done: from here on it is the quorum, the heal, the rounds
    diloco = DiLoCo(model, optimizer, sync_every=args.sync_every, fault_tolerance=fault_tolerance)
    log = Path(args.log) if args.log else None
    written = 0
    with diloco:
        while diloco.inner_step < args.steps:  # after a heal the step is the peers'
            batch = window(train, args.replica, diloco.inner_step, args.batch, args.context).to(args.device)
            model(input_ids=batch, labels=batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            written = log_rounds(diloco, log, written, joining)
    diloco.finish()  # the model is now θ
    log_rounds(diloco, log, written, joining, last=True)
    with torch.no_grad():
        val_batch = torch.stack([val[s : s + args.context] for s in range(0, 64 * args.context, args.context)])
        val_batch = val_batch.to(args.device)
        loss = model(input_ids=val_batch, labels=val_batch).loss.item()
    print(f"replica {args.replica}: val loss {loss:.4f} after {diloco.inner_step} steps", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--lighthouse", required=True, help="the address adloco lighthouse printed")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--host", default=None, help="address the peers reach this replica at (default: hostname)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda or cuda:N")
    parser.add_argument("--backend", default="auto", help="the exchange: auto (NCCL for a GPU model), gloo or nccl; "
                        "replicas sharing one GPU need gloo")  # fmt: skip
    parser.add_argument("--log", default=None, help="append one JSON line per round to this file")
    main(parser.parse_args())
