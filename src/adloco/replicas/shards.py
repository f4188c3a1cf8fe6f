"""``adloco train`` as a fault-tolerant replica whose worker is sharded over the ranks of its own torchrun job
(``shards=S``, started as ``torchrun --nproc_per_node=S``).

The S ranks are one replica: the model sharded over them as ``adloco train shards=S`` shards a worker (FSDP2, each
rank its share of every step's samples), DiLoCo's exchange and heal per shard over torchft (each rank with the
ranks that hold the same rows in the other replicas). The first rank speaks for the replica: its run directory,
records and console lines, and the evaluation of θ, gathered whole on it alone. Every rank writes its own
checkpoint (``checkpoints/shard<k>``) at the same rounds, keeping at least two, and a replica started again goes on
from the newest round every one of its ranks saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adloco.algorithms.sharding import local_rows, shard_rows
from adloco.checkpoint import REPLICA, drop_checkpoints_after, load_checkpoint, read_manifest, save_checkpoint
from adloco.errors import CheckpointError
from adloco.workers.sharded import backward_shard, load_local_optimizer_state, local_optimizer_state, sharded_copy

MIN_KEEP = 2  # a crash between two ranks' writes of a round leaves the round before it on every rank


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
        """The rank that speaks for the replica (its records, its console lines, its evaluation)."""
        return self.index == 0

    def shard(self, template: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``template`` (whole, on the CPU) sharded over the replica's ranks, only this rank's rows of it on
        ``device``."""
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

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any of the replica's ranks (a decision they must take together)."""
        return self.total(1.0 if flag else 0.0) > 0

    def whole(self, model: torch.nn.Module, rows: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The whole tensors of which ``rows`` are this rank's rows (θ, to evaluate or export) on the first rank,
        None on the others; every rank takes part. No other rank ever holds them whole."""
        gathered = [self._gather(p, r) for p, r in zip(model.parameters(), rows, strict=True)]
        return gathered if self.first else None

    def _gather(self, param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """One tensor's rows from every rank onto the first, padded to the same count for the collective."""
        total = param.shape[0]
        chunk = shard_rows(total, 0, self.count)[1]
        padded = torch.zeros((chunk, *rows.shape[1:]), dtype=rows.dtype, device=self.device)
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.count)] if self.first else None
        dist.gather(padded, parts, dst=0)
        if parts is None:
            return None
        pieces = [part[: stop - start] for part, (start, stop) in zip(parts, self._layout(total), strict=True)]
        return torch.cat(pieces).to(rows.device)

    def _layout(self, rows: int) -> list[tuple[int, int]]:
        return [shard_rows(rows, index, self.count) for index in range(self.count)]

    def save(self, directory: Path, round_number: int, keep: int, **state: Any) -> None:
        """This rank's checkpoint of the round: DiLoCo's state (its rows), and its rows of the ``model`` and of the
        ``optimizer``'s moments."""
        model, optimizer = state.pop("model"), state.pop("optimizer")
        rows = {name: local_rows(p).detach() for name, p in model.named_parameters()}
        folder = directory / f"shard{self.index}"
        folder.mkdir(parents=True, exist_ok=True)
        own = {**state, "model": rows, "optimizer": local_optimizer_state(optimizer)}
        save_checkpoint(folder, round_number, own, max(keep, MIN_KEEP), kind=REPLICA)

    def restore(
        self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Path, dict[str, Any] | None]:
        """The newest round every rank saved, loaded on every rank into its rows of the model and the inner
        optimizer (None: there is none); the folder it came from. A checkpoint any rank cannot load is an error
        on every rank (none goes on alone). Each rank forgets its checkpoints of later rounds, which another rank
        lacks: the rounds are trained again, and their new checkpoints must not meet the old ones."""
        folder = directory / f"shard{self.index}"
        entries = {int(e["round"]): e for e in read_manifest(folder) if isinstance(e.get("round"), int)}
        every: list[Any] = [None] * self.count
        dist.all_gather_object(every, sorted(entries))
        common = common_round(every)
        if common is None:
            return folder, None
        problem, saved = None, None
        try:
            saved = load_checkpoint(folder / entries[common]["file"], entries[common].get("sha256"), REPLICA)
            self._load(saved, model, optimizer)
        except CheckpointError as error:
            problem = str(error)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            problem = f"the checkpoint in {folder} is another model's ({type(error).__name__}: {error})"
        problems: list[Any] = [None] * self.count
        dist.all_gather_object(problems, problem)
        found = next((p for p in problems if p is not None), None)
        if found is not None:
            raise CheckpointError(found.splitlines()[0])
        drop_checkpoints_after(folder, common)
        return folder, saved

    def _load(self, saved: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        rows = saved["model"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                local_rows(p).copy_(rows[name])
        load_local_optimizer_state(optimizer, saved["optimizer"])

    def close(self) -> None:
        dist.destroy_process_group()


def common_round(rounds_by_rank: Sequence[Sequence[int]]) -> int | None:
    """The newest round every rank saved a checkpoint of (None: no such round)."""
    common = set.intersection(*(set(rounds) for rounds in rounds_by_rank)) if rounds_by_rank else set()
    return max(common) if common else None
