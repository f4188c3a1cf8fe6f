"""One worker: its model copy, inner AdamW (kept across rounds), data stream and gradient statistics."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from adloco.algorithms.batch_tests import GradientStatistics, statistics_from_gram, statistics_from_norms
from adloco.algorithms.codecs import ErrorFeedback
from adloco.algorithms.outer import OuterOptimizer
from adloco.algorithms.switch import MicroBatchPlan, plan_micro_batches
from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.model import next_token_loss
from adloco.probe import is_out_of_memory

log = logging.getLogger(__name__)


def split_evenly(total: int, parts: int) -> list[int]:
    """``parts`` near-equal positive sizes summing to ``total``, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


@dataclass
class StepResult:
    loss: float
    samples: int
    tokens: int
    statistics: GradientStatistics | None = None
    finite: bool = True


class EagerCopy:
    """Eager updates: a worker's own outer parameters and outer momentum, and its share of the mean Δ
    still in flight. Workers start rounds from their own copies; θ itself lags them by one exchange."""

    def __init__(self, theta: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> None:
        self.theta = [t.detach().clone() for t in theta]
        self.outer = OuterOptimizer(self.theta, lr=lr, momentum=momentum, nesterov=nesterov)
        self.share: list[torch.Tensor] | None = None

    def state_dict(self) -> dict:
        return {
            "theta": [t.clone() for t in self.theta],
            "outer": self.outer.state_dict(),
            "share": None if self.share is None else [t.clone() for t in self.share],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for t, saved in zip(self.theta, state["theta"], strict=True):
            t.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.share = None if state["share"] is None else [t.clone() for t in state["share"]]


class Worker:
    """An inner-optimisation stream. Its parameters are overwritten with θ after every outer step."""

    def __init__(
        self,
        worker_id: int,
        model: torch.nn.Module,
        inner: InnerConfig,
        stream: TokenStream,
        b_max: int,
        switch_factor: float,
        loss_fn: Callable[..., torch.Tensor] = next_token_loss,
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.stream = stream  # any sample stream of the task: next_batch(size) -> tensors, one row per sample
        self.loss_fn = loss_fn  # the task's mean loss of (model, *batch tensors)
        self.b_max = b_max
        self.switch_factor = switch_factor
        self.clip = inner.clip
        self.params = [p for p in model.parameters()]
        self.device = self.params[0].device
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": inner.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
            eps=inner.eps,
            foreach=False,
        )
        self.last_gradient: torch.Tensor | None = None
        self.error_feedback: ErrorFeedback | None = None
        self.eager: EagerCopy | None = None

    @torch.no_grad()
    def load_params(self, theta: Sequence[torch.Tensor]) -> None:
        for p, t in zip(self.params, theta, strict=True):
            p.copy_(t)

    def plan(self, b_req: int) -> MicroBatchPlan:
        """Switch mode: how this worker turns a requested batch into micro-batches on its device."""
        return plan_micro_batches(b_req, self.b_max, self.switch_factor)

    def compute_gradients(
        self, b_req: int, stats_groups: int | None = None, gram: bool = False, keep_gradient: bool = False
    ) -> StepResult:
        """Accumulate the mean gradient of one inner step into ``.grad``.

        The step reads the samples of the switch-mode plan for ``b_req``. With ``stats_groups`` those
        samples (at least 2) are split into groups whose gradients give the per-sample variance estimate
        at no extra compute. Samples are drawn once, so an out-of-memory retry with a smaller micro-batch
        sees the same data and the step is never lost.
        """
        samples = self.plan(b_req).samples
        if stats_groups is not None:
            samples = max(samples, 2)
        data = tuple(t.to(self.device) for t in self.stream.next_batch(samples))
        while True:
            try:
                result = self._accumulate(data, stats_groups, gram, keep_gradient)
                grads = [p.grad for p in self.params if p.grad is not None]
                # one host sync for the whole model rather than one per tensor
                finite_grads = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
                result.finite = math.isfinite(result.loss) and finite_grads
                return result
            except (RuntimeError, torch.OutOfMemoryError) as error:
                if not is_out_of_memory(error) or self.b_max == 1:
                    raise
                self.b_max = max(1, self.b_max // 2)
                log.warning("worker %d ran out of memory; retrying the step with b_max=%d", self.worker_id, self.b_max)
                self.optimizer.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    def _accumulate(
        self,
        data: tuple[torch.Tensor, ...],
        stats_groups: int | None,
        gram: bool,
        keep_gradient: bool,
    ) -> StepResult:
        batch = data[0].size(0)
        self.optimizer.zero_grad(set_to_none=True)
        tokens = data[0].numel()  # samples × context: the budget counts padded classification rows in full
        if stats_groups is None:
            loss = self._backward_samples(data, 0, batch, weight_total=batch)
            if keep_gradient:
                self.last_gradient = self._flat_gradient()
            return StepResult(loss=loss, samples=batch, tokens=tokens)

        sizes = split_evenly(batch, min(batch, stats_groups))
        group_means: list[torch.Tensor] = []
        total = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=self.device)
        weighted_sq = 0.0
        loss = 0.0
        start = 0
        for size in sizes:
            self.optimizer.zero_grad(set_to_none=True)
            group_loss = self._backward_samples(data, start, start + size, weight_total=size)
            group_mean = self._flat_gradient()
            loss += group_loss * size / batch
            weighted_sq += size * float(group_mean.double().square().sum())
            total.add_(group_mean, alpha=size / batch)
            if gram:
                group_means.append(group_mean)
            start += size
        self._set_flat_gradient(total)
        if gram:
            stacked = torch.stack(group_means).double()
            statistics = statistics_from_gram(stacked @ stacked.T, sizes)
        else:
            statistics = statistics_from_norms(weighted_sq, float(total.double().square().sum()), sizes)
        if keep_gradient:
            self.last_gradient = total.clone()
        return StepResult(loss=loss, samples=batch, tokens=tokens, statistics=statistics)

    def _backward_samples(self, data: tuple[torch.Tensor, ...], start: int, stop: int, weight_total: int) -> float:
        """Backward over samples [start, stop) in near-equal micro-batches of at most b_max.

        Each micro-batch's mean loss is weighted by its share of ``weight_total`` samples, so the
        accumulated gradient is the mean over all of them whatever the split.
        """
        count = stop - start
        loss_sum = 0.0
        offset = start
        for size in split_evenly(count, -(-count // self.b_max)):
            loss = self.loss_fn(self.model, *(t[offset : offset + size] for t in data))
            (loss * (size / weight_total)).backward()
            loss_sum += float(loss.detach()) * size
            offset += size
        return loss_sum / count

    def _flat_gradient(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def _set_flat_gradient(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]

    @torch.no_grad()
    def set_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(p.device, copy=True)

    def step(self, lr: float) -> float | None:
        """Clip and apply one AdamW step; returns the gradient norm before clipping when clipping is on."""
        norm = None
        if self.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=False))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def reset_optimizer(self) -> None:
        """Forget the AdamW moments (after a non-finite step they may hold NaN)."""
        self.optimizer.state.clear()

    def state_dict(self, with_params: bool = False) -> dict:
        """Inner state; the parameters only where they can differ from θ at a round boundary (streaming)."""
        return {
            "params": [p.detach().cpu().clone() for p in self.params] if with_params else None,
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "b_max": self.b_max,
            "error_feedback": None if self.error_feedback is None else self.error_feedback.state_dict(),
            "eager": None if self.eager is None else self.eager.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.b_max = int(state["b_max"])
        if state.get("params") is not None:
            self.load_params(state["params"])
        if self.error_feedback is not None and state.get("error_feedback") is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        if self.eager is not None and state.get("eager") is not None:
            self.eager.load_state_dict(state["eager"])
            self.load_params(self.eager.theta)  # it starts the next round from its own copy, not from θ
