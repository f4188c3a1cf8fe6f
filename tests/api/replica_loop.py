"""A plain PyTorch loop with ``adloco.DiLoCo`` as one fault-tolerant replica (or, ``--plain``, one torchrun rank).

``python replica_loop.py OUT --replica I --replicas N --lighthouse ADDR [--steps S] [--die-after N] [--step-seconds
T] [--min-replicas M] [--device cpu|cuda] [--backend auto|gloo|nccl] [--method diloco|streaming] [--overlap
none|delayed|eager] [--trainers T] [--shards S] [--plain]`` (``--method adloco``: its adaptive batch, on pinned
costs). Worker I's samples at inner step s are drawn from a generator seeded by (I, s) on the CPU, so a replica that
joins mid-run reads exactly the samples of the steps it takes (from ``diloco.inner_step``, which it healed from a
peer), and none of the steps before, on any device. ``--die-after N`` kills the process (SIGKILL, no clean-up) after
it took N steps, mid- round when N is not a multiple of H (``--hang-after N`` stops it there instead, SIGSTOP);
``--step-seconds`` adds that much time to each step, as a larger model's compute would. At the end it writes θ
(``OUT/replica<I>.pt``) and what each round was (``OUT/replica<I>.json``). ``--shards S``: under torchrun, each
worker's model sharded with FSDP2 over S ranks, each taking its part of the worker's batch (a replica is a torchrun
job of S ranks; ``--die-after`` kills its first rank, and torchrun the others).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

from adloco import DiLoCo

H = 4


def model(seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)


# AdLoCo's batch grows on pinned step and round costs, so every launch decides alike
ADAPTIVE = {"size": 2, "b_cap": 32, "time": {"step_seconds": [0.01, 0.001], "round_seconds": 0.05, "min_steps_left": 1}}


def batch(worker: int, step: int, device: str = "cpu", size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * worker + step)
    x = torch.randn(size, 8, generator=generator).to(device)
    return x, x.sum(dim=1, keepdim=True).sin()


def sharded_mesh(shards: int):
    """A (workers × shards) mesh over the torchrun job (one worker's shards when it is a replica) and this rank's
    shard."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh.get_local_rank("shard")


def held_out_loss(net: torch.nn.Module) -> float:
    x, y = batch(10_000, 0, next(net.parameters()).device)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), y))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replica", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--die-at", type=int, default=None, help="SIGKILL itself at the job's inner step N (replicas "
                        "that joined at different rounds die in one)")  # fmt: skip
    parser.add_argument("--hang-after", type=int, default=None, help="SIGSTOP itself after N steps (a hung process)")
    parser.add_argument("--perturb-at", type=int, default=None, help="add 0.5 to θ's first tensor at step N (a "
                        "replica that trained apart from its peers, as in a job split into two quorums)")  # fmt: skip
    parser.add_argument("--perturb-once", default=None, help="the same, once, at the first step after this file "
                        "appears")  # fmt: skip
    parser.add_argument("--exchange-timeout", type=float, default=20.0)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda: every process on GPU 0)")
    parser.add_argument("--backend", default="auto", help="the replicas' exchange: auto, gloo or nccl")
    parser.add_argument("--method", default="diloco", help="diloco, streaming (2 fragments, tau 1) or adloco")
    parser.add_argument("--overlap", default="none", help="outer.overlap: none, delayed or eager")
    parser.add_argument("--trainers", type=int, default=1, help="trainers (AdLoCo: merged every 2 rounds)")
    parser.add_argument("--sync-every", default=str(H), help="H, or auto (from 4, between 2 and 8)")
    parser.add_argument("--shards", type=int, default=1, help="each worker sharded over S torchrun ranks (FSDP2)")
    parser.add_argument("--plain", action="store_true", help="a torchrun rank over the default group instead")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    group, shard, part = None, 0, slice(None)
    if args.shards > 1:
        mesh, shard = sharded_mesh(args.shards)
        group = mesh["replicate"] if args.plain else None
        part = slice(shard * 16 // args.shards, (shard + 1) * 16 // args.shards)  # this rank's part of the batch
    if args.plain:
        if args.shards == 1:
            torch.distributed.init_process_group("gloo")
        replica, ft = torch.distributed.get_rank() // args.shards, None
    else:
        replica = args.replica
        ft = {"lighthouse": args.lighthouse, "replica": replica, "replicas": args.replicas,
              "min_replicas": args.min_replicas, "host": "127.0.0.1", "exchange_timeout_s": args.exchange_timeout,
              "quorum_timeout_s": 60.0, "backend": args.backend}  # fmt: skip
    net = model(device=args.device)
    if args.shards > 1:
        from torch.distributed.fsdp import fully_shard

        net = fully_shard(net, mesh=mesh["shard"])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    started = time.monotonic()
    outer = {"overlap": args.overlap} if args.overlap != "none" else None
    adaptive = {"batch": ADAPTIVE, "total_samples": 16 * 3 * args.steps} if args.method == "adloco" else {}
    sync_every = "auto" if args.sync_every == "auto" else int(args.sync_every)
    auto = {"sync_auto": {"start": H, "min": 2, "max": 8}} if sync_every == "auto" else {}
    diloco = DiLoCo(net, optimizer, sync_every=sync_every, method=args.method, outer=outer, fault_tolerance=ft,
                    trainers=args.trainers, process_group=group, **adaptive, **auto)  # fmt: skip
    joined = time.monotonic() - started
    if shard == 0:
        (Path(args.out) / f"replica{replica}.started").touch()  # past its first quorum: training
    first_step = diloco.inner_step
    sizes = []  # AdLoCo: each round's b
    perturbed = False
    with diloco:
        while diloco.inner_step < args.steps:
            dies = args.die_after is not None and diloco.inner_step - first_step == args.die_after
            if (dies or diloco.inner_step == args.die_at) and shard == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.hang_after is not None and diloco.inner_step - first_step == args.hang_after:
                os.kill(os.getpid(), signal.SIGSTOP)
            signalled = args.perturb_once is not None and not perturbed and Path(args.perturb_once).exists()
            if (args.perturb_at is not None and diloco.inner_step == args.perturb_at) or signalled:
                with torch.no_grad():
                    diloco.theta[0].add_(0.5)
                perturbed = True
            time.sleep(args.step_seconds)
            if not diloco.batch:
                x, y = batch(replica, diloco.inner_step, args.device)
                torch.nn.functional.mse_loss(net(x[part]), y[part]).backward()
            else:  # as many samples as the batch asks for, its backward measuring on a statistics step
                if diloco.round_step == 0:
                    sizes.append(diloco.batch.size)
                x, y = batch(replica, diloco.inner_step, args.device, diloco.batch.samples)
                diloco.batch.backward(lambda x, y: torch.nn.functional.mse_loss(net(x), y), x, y)
            optimizer.step()
            optimizer.zero_grad()
    diloco.finish()
    out = Path(args.out)
    theta = [(p.full_tensor() if args.shards > 1 else p).detach().cpu() for p in net.parameters()]
    loss = held_out_loss(net)  # every shard of a sharded worker takes part in its forward
    history = [vars(r) for r in diloco.replica.history] if diloco.replica is not None else []
    if shard > 0:  # the first rank of a sharded worker writes it whole; the others their rounds' H, b and decisions
        decided = [(h["round"], h["sync_every"], h["sync"]) for h in history]
        (out / f"replica{replica}.shard{shard}.json").write_text(json.dumps({"decided": decided, "sizes": sizes}))
        torch.distributed.destroy_process_group()
        return
    torch.save(theta, out / f"replica{replica}.pt")
    result = {"first_step": first_step, "steps": diloco.inner_step, "rounds": diloco.rounds.count,
              "joined_seconds": joined, "history": history, "loss": loss, "sizes": sizes,
              "merges": [m.to_dict() for m in diloco.merges], "trainers": sorted(diloco.trainers)}  # fmt: skip
    (out / f"replica{replica}.json").write_text(json.dumps(result))
    if args.plain or args.shards > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
