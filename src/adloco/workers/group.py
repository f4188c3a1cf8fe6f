"""Workers of one rank run as one computation: their parameters, gradients and AdamW moments live in tensors
stacked along a leading worker dimension, and each worker's model and optimizer hold views into them.

Every worker keeps its own numbers (data stream, loss, gradient, clipping, moments); the group only changes how
they are computed: one stacked forward and backward (``adloco.models.stacked``) and one stacked AdamW update
(``adloco.algorithms.adamw``) instead of W of each. Where workers differ in what a step needs (learning rate,
β2) or a step needs more than a plain gradient (the cross-worker estimator's), the caller falls back to the
workers one by one, which reads and writes the same views.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from itertools import groupby

import torch

from adloco.algorithms.adamw import AdamWSettings, adamw_stacked, clip_stacked
from adloco.algorithms.batch_tests import GradientStatistics, GroupedGradient
from adloco.algorithms.flat import finite_rows, flatten, unflatten
from adloco.algorithms.switch import split_evenly
from adloco.models.compilation import compiled
from adloco.models.precision import autocast_for, until_no_overflow
from adloco.models.stacked import StackedLlama, unsupported_reason
from adloco.workers.inner_optimizer import MuonWithAdamW, adamw_groups, set_inner_lr
from adloco.workers.probe import is_out_of_memory
from adloco.workers.worker import StepResult, Worker, backward_in_groups, backward_in_micro_batches

log = logging.getLogger(__name__)


def stacking_blocker(workers: Sequence[Worker]) -> str | None:
    """Why these workers cannot run as one group (None when they can)."""
    if len(workers) < 2:
        return "a rank with one worker has nothing to stack"
    if any(worker.shards > 1 for worker in workers):
        return "sharded workers step one at a time"
    reason = unsupported_reason(workers[0].model, workers[0].loss_fn)
    if reason is not None:
        return reason
    first = workers[0]
    shapes = [tuple(p.shape) for p in first.params]
    for worker in workers[1:]:
        if [tuple(p.shape) for p in worker.params] != shapes or worker.device != first.device:
            return "the workers' models differ in shape or device"
        if (worker.loss_fn, worker.precision, worker.compile_step) != (
            first.loss_fn,
            first.precision,
            first.compile_step,
        ):
            return "the workers differ in loss, precision or compilation"
    return None


class WorkerGroup:
    """W workers of one model shape on one device, computed and stepped as one."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        reason = stacking_blocker(workers)
        if reason is not None:
            raise ValueError(f"these workers cannot be stacked: {reason}")
        self.workers = list(workers)
        self.worker_ids = [w.worker_id for w in self.workers]
        first = self.workers[0]
        self.device, self.precision, self.clip = first.device, first.precision, first.clip
        self.fits = True  # False once a stacked step ran out of memory: the workers then compute one by one
        self.forward = StackedLlama(first.model)
        self.losses = compiled(self.forward.losses, first.compile_step)
        with torch.no_grad():
            self.params = [torch.stack([w.params[i].detach() for w in self.workers]) for i in range(len(first.params))]
        for k, worker in enumerate(self.workers):
            for i, p in enumerate(worker.params):
                p.data = self.params[i][k]  # the worker's parameter is now a view into the stack
        for stacked in self.params:
            stacked.requires_grad_(True)
        # The stacked update is AdamW's; Muon (inner.optimizer=muon) steps each worker's hidden matrices itself.
        decay_of = {id(p): g["weight_decay"] for g in adamw_groups(first.optimizer) for p in g["params"]}
        self.adamw = [i for i, p in enumerate(first.params) if id(p) in decay_of]  # positions AdamW steps
        stacked_adamw = [self.params[i] for i in self.adamw]
        self.exp_avgs = [torch.zeros_like(p) for p in stacked_adamw]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in stacked_adamw]
        self.scratch = [torch.empty_like(p) for p in stacked_adamw]  # AdamW's denominators, reused every step
        # AdamW keeps its step counts on the CPU, fused AdamW on the device
        fused = any(g.get("fused") for g in adamw_groups(first.optimizer))
        on = self.device if fused else torch.device("cpu")
        self.steps = [torch.zeros(len(self.workers), device=on) for _ in stacked_adamw]
        self.weight_decay = [decay_of[id(first.params[i])] for i in self.adamw]
        self.bound = [
            [
                {"step": self.steps[j][k], "exp_avg": self.exp_avgs[j][k], "exp_avg_sq": self.exp_avg_sqs[j][k]}
                for j in range(len(self.adamw))
            ]
            for k in range(len(self.workers))
        ]
        for k in range(len(self.workers)):
            self._bind_state(k)

    def _bind_state(self, k: int) -> None:
        """Point worker k's AdamW state at its slices of the stack, taking over whatever state it holds now
        (a resumed checkpoint's, or none after a reset)."""
        optimizer, bound = self.workers[k].optimizer, self.bound[k]
        params = [self.workers[k].params[i] for i in self.adamw]
        # A resume or a reset replaces or clears the whole state, so the first tensor tells whether it is still bound.
        if optimizer.state.get(params[0]) is bound[0]:
            return
        with torch.no_grad():
            for p, views in zip(params, bound, strict=True):
                held = optimizer.state.get(p, {})
                for key, view in views.items():
                    view.copy_(held[key]) if key in held else view.zero_()
                optimizer.state[p] = views

    def compute_gradients(
        self, samples: int, b_max: int, stats_groups: int | None = None, gram: bool = False
    ) -> list[StepResult]:
        """Each worker's mean gradient over ``samples`` of its own samples, in micro-batches of at most ``b_max``,
        left in its ``.grad``; with ``stats_groups``, also its gradient statistics (as ``Worker.compute_gradients``
        computes them). Where the stacked step does not fit in memory, the same samples go through the workers one
        at a time (each of which halves its micro-batch as it needs)."""
        if stats_groups is not None:
            samples = max(samples, 2)
        data = [tuple(t.to(self.device) for t in w.stream.next_batch(samples)) for w in self.workers]
        stacked = tuple(torch.stack(parts) for parts in zip(*data, strict=True))
        scales_before = [w.loss_scale.scale for w in self.workers]
        try:
            losses, statistics, finite = self._scaled_step(stacked, b_max, stats_groups, gram)
        except (RuntimeError, torch.OutOfMemoryError) as error:
            if not is_out_of_memory(error):
                raise
            log.warning("workers %s do not fit stacked; from now on they compute one at a time", self.worker_ids)
            self.fits = False  # b_max was probed for one worker: the stack holds W times its activations
            self._clear_gradients()
            for worker, scale in zip(self.workers, scales_before, strict=True):
                worker.loss_scale.scale = scale
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return [
                w.compute_gradients(samples, b_max, stats_groups=stats_groups, gram=gram, data=d)
                for w, d in zip(self.workers, data, strict=True)
            ]
        for worker, ok, scale in zip(self.workers, finite, scales_before, strict=True):
            worker.loss_scale.settle(ok, scale)
        tokens = data[0][0].numel()
        return [
            StepResult(loss, samples, tokens, stats, finite=ok, b_max=b_max)
            for loss, stats, ok in zip(losses, statistics, finite, strict=True)
        ]

    def _scaled_step(
        self, data: tuple[torch.Tensor, ...], b_max: int, stats_groups: int | None, gram: bool
    ) -> tuple[list[float], list[GradientStatistics | None], list[bool]]:
        """The stacked step, computed again on the same samples while a worker's fp16 gradients overflowed and its
        loss scale can still halve (each worker's gradient depends on its own scale only); whether each worker's
        loss and gradient came out finite."""

        def attempt() -> tuple[list[float], list[GradientStatistics | None], list[bool]]:
            losses, statistics = self._accumulate(data, b_max, stats_groups, gram)
            rows = finite_rows([p.grad for p in self.params]).tolist()
            return losses, statistics, [ok and math.isfinite(loss) for ok, loss in zip(rows, losses, strict=True)]

        scales = [w.loss_scale for w in self.workers]
        return until_no_overflow(
            attempt, lambda r: list(zip(r[2], r[0], strict=True)), scales, f"workers {self.worker_ids}"
        )

    def _accumulate(
        self, data: tuple[torch.Tensor, ...], b_max: int, stats_groups: int | None, gram: bool
    ) -> tuple[list[float], list[GradientStatistics | None]]:
        """The step's backward passes: over all samples at once, or group by group for the statistics."""
        batch = data[0].size(1)
        self._clear_gradients()
        if stats_groups is None:
            losses = self._backward(data, 0, batch, batch, b_max)
            self._lend_gradients()
            return losses, [None] * len(self.workers)
        sizes = split_evenly(batch, min(batch, stats_groups))
        numel = sum(p[0].numel() for p in self.params)
        grouped = [GroupedGradient(sizes, numel, gram, self.device) for _ in self.workers]

        def backward_group(start: int, size: int) -> list[float]:
            self._clear_gradients()
            group_losses = self._backward(data, start, start + size, size, b_max)
            for k, accumulator in enumerate(grouped):
                accumulator.add(flatten([p.grad[k] for p in self.params]), size)
            return group_losses

        losses = backward_in_groups(sizes, backward_group)
        totals = [unflatten(accumulator.total, [p[0] for p in self.params]) for accumulator in grouped]
        for i, stacked in enumerate(self.params):
            stacked.grad = torch.stack([total[i] for total in totals])
        self._lend_gradients()
        return losses, [accumulator.statistics() for accumulator in grouped]

    def _backward(
        self, data: tuple[torch.Tensor, ...], start: int, stop: int, weight_total: int, b_max: int
    ) -> list[float]:
        """``Worker``'s micro-batched backward for W workers at once; their mean losses."""

        def loss_of(offset: int, size: int) -> torch.Tensor:
            with autocast_for(self.precision, self.device):
                return self.losses(self.params, *(t[:, offset : offset + size] for t in data))

        if not self.workers[0].loss_scale.enabled:
            return backward_in_micro_batches(loss_of, start, stop, weight_total, b_max).tolist()
        scales = torch.tensor([w.loss_scale.scale for w in self.workers], device=self.device)
        losses = backward_in_micro_batches(loss_of, start, stop, weight_total, b_max, scales).tolist()
        with torch.no_grad():
            for stacked in self.params:
                if stacked.grad is not None:
                    stacked.grad.mul_((1 / scales).view(-1, *[1] * (stacked.dim() - 1)))
        return losses

    def _lend_gradients(self) -> None:
        """Each worker's ``.grad`` becomes its slice of the stacked gradient."""
        for k, worker in enumerate(self.workers):
            for stacked, p in zip(self.params, worker.params, strict=True):
                p.grad = stacked.grad[k]

    def _clear_gradients(self) -> None:
        for stacked in self.params:
            stacked.grad = None
        for worker in self.workers:
            worker.optimizer.zero_grad(set_to_none=True)

    def step(self, lrs: Sequence[float]) -> bool:
        """Clip and apply one AdamW step to every worker at once (lr ``lrs[k]`` for worker k). False, with nothing
        changed, where the workers cannot share one update: their lr or β2 differ, or a gradient is missing; the
        caller then steps them one by one. Workers at different step counts (one that restarted its moments, or
        joined an elastic run) take their bias corrections in runs of neighbours at the same count."""
        for k in range(len(self.workers)):
            self._bind_state(k)
        settings = self._settings(lrs)
        steps = torch.stack(self.steps)  # [tensors, workers]
        if settings is None or bool((steps != steps[0]).any()):
            return False
        grads = self._gathered_gradients()
        if grads is None:
            return False
        if self.clip is not None:
            clip_stacked(grads, self.clip)
        params = [self.params[i].detach() for i in self.adamw]
        adamw_grads = [grads[i] for i in self.adamw]
        for start, stop, count in _runs_of_equal(steps[0].tolist()):
            rows = slice(start, stop)  # views, so the update lands in the stack
            adamw_stacked(
                [p[rows] for p in params],
                [g[rows] for g in adamw_grads],
                [m[rows] for m in self.exp_avgs],
                [v[rows] for v in self.exp_avg_sqs],
                int(count) + 1,
                self.weight_decay,
                settings,
                [s[rows] for s in self.scratch],
            )
        for count in self.steps:
            count.add_(1)
        for k, worker in enumerate(self.workers):  # as Worker.step leaves it: a checkpoint saves the lr last used
            set_inner_lr(worker.optimizer, settings.lr)
            if isinstance(worker.optimizer, MuonWithAdamW):  # its hidden matrices: views into the stack
                for p, grad in zip(worker.params, grads, strict=True):
                    p.grad = grad[k]  # the clipped gradient, even where a sync strategy replaced its .grad
                worker.optimizer.muon.step()
        self._clear_gradients()
        return True

    def _settings(self, lrs: Sequence[float]) -> AdamWSettings | None:
        groups = [g for w in self.workers for g in adamw_groups(w.optimizer)]
        betas = {tuple(g["betas"]) for g in groups}
        eps = {g["eps"] for g in groups}
        if len(set(lrs)) != 1 or len(betas) != 1 or len(eps) != 1:
            return None
        (beta1, beta2), (only_eps,) = betas.pop(), eps
        return AdamWSettings(lr=lrs[0], beta1=beta1, beta2=beta2, eps=only_eps)

    def _gathered_gradients(self) -> list[torch.Tensor] | None:
        """The workers' gradients in the stack: where a sync strategy replaced a worker's ``.grad`` (an
        all-reduce), its values are copied in."""
        grads = []
        for i, stacked in enumerate(self.params):
            target = stacked.grad if stacked.grad is not None else torch.zeros_like(stacked)
            for k, worker in enumerate(self.workers):
                grad = worker.params[i].grad
                if grad is None:
                    return None
                if grad.data_ptr() != target[k].data_ptr():
                    target[k].copy_(grad)
            grads.append(target)
        return grads


def _runs_of_equal(values: Sequence[float]) -> list[tuple[int, int, float]]:
    """(start, stop, value) of each maximal run of equal neighbours in ``values``."""
    runs, start = [], 0
    for value, run in groupby(values):
        length = sum(1 for _ in run)
        runs.append((start, start + length, value))
        start += length
    return runs
