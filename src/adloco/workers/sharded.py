"""A worker that spans several ranks: its model is sharded over them with FSDP2 (``fully_shard``).

Each rank of the worker holds some rows of every parameter (``adloco.algorithms.sharding``), its AdamW moments for
those rows, and a share of every inner step's samples. FSDP gathers the parameters for the forward and
reduce-scatters the gradients, summed over the ranks, each rank's samples weighted by their share of the worker's
batch: the worker's step is the same as on one rank. To the sync strategies and the trainer the worker looks like
any other whose parameters are this rank's rows; they exchange those rows with the ranks that hold the same rows
of the other workers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from adloco.algorithms.sharding import local_rows, shard_rows, sharded_like
from adloco.algorithms.switch import split_evenly
from adloco.config import InnerConfig
from adloco.models.precision import autocast_for
from adloco.workers.worker import StepResult, Worker, backward_in_micro_batches

if TYPE_CHECKING:  # FSDP and the model library take seconds to import; a loop that shards nothing never needs them
    from torch.distributed.device_mesh import DeviceMesh

    from adloco.data import TokenStream
    from adloco.workers.tasks import Task


def sharded_copy(template: torch.nn.Module, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """A copy of ``template`` sharded over ``mesh`` on ``device``, where only this rank's rows of each parameter are
    ever allocated: the copy starts on the meta device, is sharded, and then takes its rows from ``template``."""
    placeholders = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in template.parameters()}
    model = shard_model(copy.deepcopy(template, placeholders), mesh)  # buffers (small) are copied whole
    model.to_empty(device=device)
    index, count = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        for param, whole in zip(model.parameters(), template.parameters(), strict=True):
            start, stop = shard_rows(whole.size(0), index, count)
            param.to_local().copy_(whole[start:stop])
        for buffer, whole in zip(model.buffers(), template.buffers(), strict=True):
            buffer.copy_(whole)
    return model


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """``model`` sharded over ``mesh``: every block of its layer lists on its own (so only one block's parameters
    are gathered at a time), then the rest. Gradients are summed over the shards, not averaged."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    blocks: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(block + ".") for block in blocks)
        if isinstance(module, torch.nn.ModuleList) and not inside:
            blocks.extend(f"{name}.{index}" for index in range(len(module)))
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no scaled-sum reduction
    return model


class ShardedWorker(Worker):
    """A worker whose model (from ``sharded_copy``), gradients and AdamW state are sharded over the ranks of
    ``mesh``."""

    def __init__(
        self,
        worker_id: int,
        model: torch.nn.Module,
        inner: InnerConfig,
        stream: TokenStream,
        *,
        mesh: DeviceMesh,
        sum_over_shards: Callable[[torch.Tensor], torch.Tensor],
        **options: Any,
    ) -> None:
        self.mesh = mesh
        self.shards, self.shard = mesh.size(), mesh.get_local_rank()
        self._sum_over_shards = sum_over_shards
        super().__init__(worker_id, model, inner, stream, **options)

    @property
    def params(self) -> list[torch.Tensor]:
        # Views, taken anew: FSDP may replace a parameter's local storage when it first runs.
        return [p.to_local().detach() for p in self.model_params]

    def sum_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        return self._sum_over_shards(values)

    def scratch_step(self, task: Task) -> Callable[[int], None]:
        """A timed step for the cost model: the forward and backward of this rank's share of ``batch`` scratch
        samples on the worker's own model (a sharded model cannot be copied), leaving no gradient behind."""

        def step(batch: int) -> None:
            share = -(-batch // self.shards)
            with autocast_for(self.precision, self.device):
                loss = task.loss(self.model, *task.scratch_batch(share, self.device))
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)

        return step

    def gradients(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.to_local().detach() for p in self.model_params]

    @torch.no_grad()
    def set_gradients(self, grads: list[torch.Tensor]) -> None:  # type: ignore[override]
        for p, g in zip(self.model_params, grads, strict=True):
            p.grad = sharded_like(p, g.to(self.device, copy=True))

    def _backward_share(
        self,
        loss_of: Callable[[int, int], torch.Tensor],
        start: int,
        stop: int,
        weight_total: int,
        b_max: int,
        scale: float | None,
    ) -> float:
        """This rank's share of samples [start, stop) (``backward_shard``); the worker's mean loss."""
        shard = (self.shard, self.shards)
        return backward_shard(loss_of, start, stop, weight_total, b_max, scale, shard, self.sum_over_shards)

    def _fitting_step(self, accumulate: Callable[[int], StepResult], b_max: int) -> StepResult:
        """No retry with a smaller micro-batch after running out of memory: the worker's other ranks would be
        waiting in a collective of the step that failed (set ``batch.memory.b_max`` instead)."""
        return self._checked(accumulate(b_max), b_max)

    def _optimizer_state(self) -> dict:
        return local_optimizer_state(self.optimizer)

    def _load_optimizer_state(self, state: dict) -> None:
        load_local_optimizer_state(self.optimizer, state)


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """A sharded model's optimizer state with this rank's rows of each moment (plain tensors, saved by any rank)."""
    state = optimizer.state_dict()
    local = {k: {n: local_rows(v) for n, v in s.items()} for k, s in state["state"].items()}
    return {**state, "state": local}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``local_optimizer_state``'s rows back into the optimizer of the same sharded model."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    distributed = {
        k: {n: sharded_like(params[int(k)], v) if _moment(v) else v for n, v in s.items()}
        for k, s in state["state"].items()
    }
    optimizer.load_state_dict({**state, "state": distributed})


def backward_shard(
    loss_of: Callable[[int, int], torch.Tensor],
    start: int,
    stop: int,
    weight_total: int,
    b_max: int,
    scale: float | None,
    shard: tuple[int, int],
    sum_over_shards: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """The backward of shard ``shard`` = (index, count) of a sharded worker over its share of samples [start, stop),
    in as many micro-batches as every other shard runs (FSDP's collectives pair up micro-batch by micro-batch), each
    weighted by its share of ``weight_total``; the worker's mean loss, summed over the shards."""
    index, count = shard
    shares = split_evenly(stop - start, count)
    low = start + sum(shares[:index])
    high = low + shares[index]
    if low == high:
        low = high = start  # no samples here: stand-in micro-batches of weight zero read a sample that exists
    micro_batches = split_evenly(high - low, -(-shares[0] // b_max))
    mean = backward_in_micro_batches(loss_of, low, high, weight_total, b_max, scale, micro_batches)
    total = sum_over_shards((mean * (high - low)).reshape(1))
    return float(total[0]) / (stop - start)


def _moment(value: Any) -> bool:
    """A per-element optimizer state (AdamW's moments), not a scalar such as its step count."""
    return torch.is_tensor(value) and value.dim() > 0
