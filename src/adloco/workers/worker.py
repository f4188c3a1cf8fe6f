"""One worker: its model copy, inner optimizer (AdamW, or Muon and AdamW; kept across rounds), data stream and
gradient statistics.

It computes and steps; it never communicates (that is the sync strategy's job, ``adloco.sync``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from adloco.algorithms.batch_tests import GradientStatistics, GroupedGradient
from adloco.algorithms.flat import finite_rows, flatten, unflatten
from adloco.algorithms.switch import split_evenly
from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.models.compilation import compiled
from adloco.models.losses import next_token_loss
from adloco.models.precision import LossScale, adamw_kernel, autocast_for, until_no_overflow
from adloco.workers.inner_optimizer import adamw_groups, inner_optimizer, set_inner_lr
from adloco.workers.probe import is_out_of_memory

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float
    samples: int
    tokens: int
    statistics: GradientStatistics | None = None
    finite: bool = True
    b_max: int = 0  # the micro-batch cap that worked (an out-of-memory error halves it)


class Worker:
    """An inner-optimisation stream. Its parameters are overwritten with θ after every outer step."""

    def __init__(
        self,
        worker_id: int,
        model: torch.nn.Module,
        inner: InnerConfig,
        stream: TokenStream,
        loss_fn: Callable[..., torch.Tensor] = next_token_loss,
        precision: str = "fp32",
        compile_step: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.precision = precision  # the forward's autocast (adloco.models.precision); the state stays float32
        self.loss_scale = LossScale.for_precision(precision)
        self.model = model
        self.stream = stream  # any sample stream of the task: next_batch(size) -> tensors, one row per sample
        self.loss_fn = loss_fn  # the task's mean loss of (model, *batch tensors)
        self.step_loss = compiled(loss_fn, compile_step)  # what a training step calls: loss_fn, maybe compiled
        self.compile_step = compile_step
        self.clip = inner.clip
        self.model_params = list(model.parameters())  # what the inner optimizer and clipping update
        self.device = self.params[0].device
        self.optimizer = inner_optimizer(model, inner, adamw_kernel(self.device))
        self.beta2 = inner.beta2  # the configured one; a trainer's batch coupling derives the one in use
        self.last_gradient: torch.Tensor | None = None

    shards = 1  # ranks that hold a part of this worker's model

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters in θ's shape, as the sync strategies read and overwrite them (a sharded worker: views
        of this rank's rows)."""
        return self.model_params

    def sum_over_shards(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the shards of this worker (a sharded worker's ranks)."""
        return values

    def set_beta2(self, beta2: float) -> None:
        for group in adamw_groups(self.optimizer):
            group["betas"] = (group["betas"][0], beta2)

    @torch.no_grad()
    def load_params(self, theta: Sequence[torch.Tensor]) -> None:
        for p, t in zip(self.params, theta, strict=True):
            p.copy_(t)

    def compute_gradients(
        self,
        samples: int,
        b_max: int,
        stats_groups: int | None = None,
        gram: bool = False,
        keep_gradient: bool = False,
        data: tuple[torch.Tensor, ...] | None = None,
    ) -> StepResult:
        """Accumulate the mean gradient of one inner step over ``samples`` samples into ``.grad``, in
        micro-batches of at most ``b_max``.

        With ``stats_groups`` those samples (at least 2) are split into groups whose gradients give the
        per-sample variance estimate at no extra compute. Samples are drawn once, so an out-of-memory retry
        with half the micro-batch sees the same data and the step is never lost; the result reports the cap
        that worked. ``data``: samples already drawn from the stream (a stacked step that did not fit).
        """
        if stats_groups is not None:
            samples = max(samples, 2)
        if data is None:
            data = tuple(t.to(self.device) for t in self.stream.next_batch(samples))
        scale_before = self.loss_scale.scale

        cap = [b_max]  # an out-of-memory retry's smaller micro-batch holds for the fp16 retries too

        def attempt() -> StepResult:
            result = self._fitting_step(lambda micro: self._accumulate(data, micro, stats_groups, gram, keep_gradient),
                                        cap[0])  # fmt: skip
            cap[0] = result.b_max
            return result

        result = until_no_overflow(
            attempt, lambda r: [(r.finite, r.loss)], [self.loss_scale], f"worker {self.worker_id}"
        )
        self.loss_scale.settle(result.finite, scale_before)
        return result

    def _fitting_step(self, accumulate: Callable[[int], StepResult], b_max: int) -> StepResult:
        """One step's gradients from ``accumulate(micro_batch)``, halving the micro-batch until it fits in memory."""
        while True:
            try:
                return self._checked(accumulate(b_max), b_max)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                if not is_out_of_memory(error) or b_max == 1:
                    raise
                b_max = max(1, b_max // 2)
                log.warning("worker %d ran out of memory; retrying the step with b_max=%d", self.worker_id, b_max)
                self.optimizer.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    def _checked(self, result: StepResult, b_max: int) -> StepResult:
        """``result`` with its health (a finite loss and gradient) and the micro-batch cap that worked."""
        result.finite = math.isfinite(result.loss) and self._gradients_finite()
        result.b_max = b_max
        return result

    def _gradients_finite(self) -> bool:
        # a shard past a small parameter's last row holds none of it
        grads = [g.reshape(1, -1) for g in self.gradients() if g is not None and g.numel() > 0]
        # one host sync for the whole model rather than one per tensor
        finite = finite_rows(grads).double() if grads else torch.ones(1, dtype=torch.float64)
        return bool(self.sum_over_shards(1 - finite) == 0)  # a sharded worker's shards must agree

    def _accumulate(
        self,
        data: tuple[torch.Tensor, ...],
        b_max: int,
        stats_groups: int | None,
        gram: bool,
        keep_gradient: bool,
    ) -> StepResult:
        batch = data[0].size(0)
        self.optimizer.zero_grad(set_to_none=True)
        tokens = data[0].numel()  # samples × context: the budget counts padded classification rows in full
        if stats_groups is None:
            loss = self._backward_samples(data, 0, batch, batch, b_max)
            if keep_gradient:
                self.last_gradient = self._flat_gradient()
            return StepResult(loss=loss, samples=batch, tokens=tokens)

        sizes = split_evenly(batch, min(batch, stats_groups))
        grouped = GroupedGradient(sizes, sum(p.numel() for p in self.params), gram, self.device)

        def backward_group(start: int, size: int) -> list[float]:
            self.optimizer.zero_grad(set_to_none=True)
            group_loss = self._backward_samples(data, start, start + size, size, b_max)
            grouped.add(self._flat_gradient(), size)
            return [group_loss]

        (loss,) = backward_in_groups(sizes, backward_group)
        self._set_flat_gradient(grouped.total)
        if keep_gradient:
            self.last_gradient = grouped.total.clone()
        return StepResult(loss=loss, samples=batch, tokens=tokens, statistics=grouped.statistics(self.sum_over_shards))

    def _backward_samples(
        self, data: tuple[torch.Tensor, ...], start: int, stop: int, weight_total: int, b_max: int
    ) -> float:
        """Backward over samples [start, stop) in near-equal micro-batches of at most ``b_max``.

        Each micro-batch's mean loss is weighted by its share of ``weight_total`` samples, so the
        accumulated gradient is the mean over all of them whatever the split.
        """

        def loss_of(offset: int, size: int) -> torch.Tensor:
            with autocast_for(self.precision, self.device):
                return self.step_loss(self.model, *(t[offset : offset + size] for t in data))

        scale = self.loss_scale.scale if self.loss_scale.enabled else None
        loss = self._backward_share(loss_of, start, stop, weight_total, b_max, scale)
        if scale is not None:
            with torch.no_grad():
                for grad in self.gradients():
                    if grad is not None:
                        grad.mul_(1 / scale)
        return loss

    def _backward_share(
        self,
        loss_of: Callable[[int, int], torch.Tensor],
        start: int,
        stop: int,
        weight_total: int,
        b_max: int,
        scale: float | None,
    ) -> float:
        """Backward over this worker's samples [start, stop); the mean loss."""
        return float(backward_in_micro_batches(loss_of, start, stop, weight_total, b_max, scale))

    def _flat_gradient(self) -> torch.Tensor:
        grads = self.gradients()
        return flatten([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.params, strict=True)])

    def _set_flat_gradient(self, flat: torch.Tensor) -> None:
        self.set_gradients(unflatten(flat, self.params))

    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients in θ's shape (a sharded worker: this rank's rows; writing to them writes the gradient)."""
        return [p.grad for p in self.params]

    @torch.no_grad()
    def set_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(p.device, copy=True)

    def step(self, lr: float) -> float | None:
        """Clip and apply one inner optimizer step; returns the gradient norm before clipping when clipping is on."""
        norm = None
        if self.clip is not None:
            norm = float(full_value(torch.nn.utils.clip_grad_norm_(self.model_params, self.clip, foreach=False)))
        set_inner_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments (after a non-finite step they may hold NaN)."""
        self.optimizer.state.clear()

    def state_dict(self, with_params: bool = False) -> dict:
        """Inner state; the parameters only where they can differ from θ at a round boundary (streaming)."""
        return {
            "params": [p.detach().cpu().clone() for p in self.params] if with_params else None,
            # a copy: a worker group's moments are views into its stacked tensors, which a save must not alias
            "optimizer": _copied(self._optimizer_state()),
            "stream": self.stream.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
        }

    def _optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        self._load_optimizer_state(state["optimizer"])
        kernel = adamw_kernel(self.device)  # the saved groups name the kernel of the device they were saved on
        for group in adamw_groups(self.optimizer):
            group["fused"], group["foreach"] = kernel.get("fused"), kernel.get("foreach")
        self.stream.load_state_dict(state["stream"])
        self.loss_scale.load_state_dict(state["loss_scale"])
        if state["params"] is not None:  # None: the worker starts the round from θ
            self.load_params(state["params"])


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``value``'s whole value (a DTensor's ``full_tensor()``, collective over its mesh)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _copied(state: dict) -> dict:
    """An optimizer state dict whose tensors own their memory."""
    return {
        "state": {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def backward_in_micro_batches(
    loss_of: Callable[[int, int], torch.Tensor],
    start: int,
    stop: int,
    weight_total: int,
    b_max: int,
    loss_scale: float | torch.Tensor | None = None,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Backward over samples [start, stop) in near-equal micro-batches of at most ``b_max``; the mean loss
    (float64, one per worker where ``loss_of(offset, size)`` gives a worker group's losses).

    Each micro-batch's mean loss is weighted by its share of ``weight_total`` samples, so the accumulated gradient
    is the mean over all of them whatever the split; with ``loss_scale`` (one per worker for a group) that gradient
    is the scaled one, which the caller divides back. ``sizes``: the micro-batches, given; one of size 0 runs a
    forward and backward of weight zero on sample ``start`` (a sharded worker's rank with fewer samples than its
    peers still takes part in every micro-batch's collectives). Where there are no samples the loss is 0.
    """
    count = stop - start
    loss_sum = torch.zeros((), dtype=torch.float64)
    offset = start
    for size in split_evenly(count, -(-count // b_max)) if sizes is None else sizes:
        if size == 0:
            (loss_of(start, 1).sum() * 0.0).backward()
            continue
        loss = loss_of(offset, size)
        scaled = loss if loss_scale is None else loss * loss_scale
        (scaled.sum() * (size / weight_total)).backward()
        loss_sum = loss_sum + loss.detach().double().cpu() * size
        offset += size
    return loss_sum / max(count, 1)


def backward_in_groups(sizes: Sequence[int], backward_group: Callable[[int, int], Sequence[float]]) -> list[float]:
    """A statistics step's backward, group after group of the step's samples (``backward_group(start, size)``
    runs one group, takes its gradient and gives each worker's mean loss over it: one worker, or several stacked);
    each worker's mean loss over the step, weighted as the groups' sizes are."""
    batch = sum(sizes)
    losses: list[float] = []
    start = 0
    for size in sizes:
        group = backward_group(start, size)
        losses = [*(loss + g * size / batch for loss, g in zip(losses or [0.0] * len(group), group, strict=True))]
        start += size
    return losses
