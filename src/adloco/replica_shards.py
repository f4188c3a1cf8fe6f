"""``adloco train`` as a fault-tolerant replica whose worker is sharded over the ranks of its own torchrun job
(``shards=S``, started as ``torchrun --nproc_per_node=S``).

The S ranks are one replica: the model sharded over them as ``adloco train shards=S`` shards a worker (FSDP2, each
rank its share of every step's samples), DiLoCo's exchange and heal per shard over torchft (each rank with the
ranks that hold the same rows in the other replicas). The first rank speaks for the replica: its run directory,
records and console lines. Every rank writes its own checkpoint (``checkpoints/shard<k>``), and a replica started
again goes on from the newest round every one of its shards saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adloco.algorithms.sharding import local_rows, sharded_like
from adloco.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from adloco.sharded_worker import backward_shard, load_local_optimizer_state, local_optimizer_state, sharded_copy


class ReplicaShards:
    """This rank as shard ``index`` of the ``count`` ranks of one replica's torchrun job."""

    def __init__(self, count: int, device: torch.device, timeout_s: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from adloco.comm.distributed import start_process_group

        start_process_group("nccl" if device.type == "cuda" else "gloo", timeout_s)
        self.index, self.count = dist.get_rank(), count
        self.mesh = init_device_mesh(device.type, (count,))
        # where the shard group's collectives take tensors: the GPU for NCCL, the CPU for gloo
        self.device = device if device.type == "cuda" else torch.device("cpu")

    @property
    def first(self) -> bool:
        """The rank that speaks for the replica (its records, its console lines)."""
        return self.index == 0

    def shard(self, template: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``template`` sharded over the replica's ranks, only this rank's rows of it allocated on ``device``."""
        return sharded_copy(template, self.mesh, device)

    def backward(self, loss_of: Callable[[int, int], torch.Tensor], samples: int, b_max: int) -> float:
        """This rank's share of the step's ``samples`` (as ``adloco train shards=S`` splits a worker's step); the
        worker's mean loss."""
        return backward_shard(loss_of, 0, samples, samples, b_max, None, (self.index, self.count), self._sum)

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        total = values.to(self.device, dtype=torch.float64)
        dist.all_reduce(total)
        return total.cpu()

    def total(self, value: float) -> float:
        """``value`` summed over the replica's ranks (the bytes each sent of its rows)."""
        return float(self._sum(torch.tensor([value]))[0])

    def whole(self, model: torch.nn.Module, rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The whole tensors of which ``rows`` are this rank's rows (θ, to evaluate or export), on every rank."""
        return [
            sharded_like(p, r.to(local_rows(p).device)).full_tensor()
            for p, r in zip(model.parameters(), rows, strict=True)
        ]

    def save(self, directory: Path, round_number: int, keep: int, **state: Any) -> None:
        """This rank's checkpoint of the round: DiLoCo's state (its rows), and its rows of the ``model`` and of the
        ``optimizer``'s moments."""
        model, optimizer = state.pop("model"), state.pop("optimizer")
        rows = {name: local_rows(p).detach() for name, p in model.named_parameters()}
        folder = directory / f"shard{self.index}"
        folder.mkdir(parents=True, exist_ok=True)
        own = {**state, "model": rows, "optimizer": local_optimizer_state(optimizer)}
        save_checkpoint(folder, round_number, own, keep)

    def newest(self, directory: Path) -> tuple[Path, dict[str, Any]] | None:
        """The newest round every rank of the replica saved, read from this rank's folder (None: there is none);
        a crash between two ranks' writes leaves the round before it."""
        folder = directory / f"shard{self.index}"
        entries = {int(e["round"]): e for e in read_manifest(folder) if isinstance(e.get("round"), int)}
        every: list[Any] = [None] * self.count
        dist.all_gather_object(every, sorted(entries))
        common = set.intersection(*(set(rounds) for rounds in every))
        if not common:
            return None
        entry = entries[max(common)]
        return folder, load_checkpoint(folder / entry["file"], entry.get("sha256"))

    def load(self, saved: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A checkpoint's rows of the model and of the inner optimizer's moments into this rank's."""
        rows = saved["model"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                local_rows(p).copy_(rows[name])
        load_local_optimizer_state(optimizer, saved["optimizer"])

    def close(self) -> None:
        dist.destroy_process_group()
