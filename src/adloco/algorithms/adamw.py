"""AdamW and gradient clipping over stacked tensors: one update for W workers whose parameters share a leading
worker dimension, each worker's numbers its own (the math of ``torch.optim.AdamW`` and ``clip_grad_norm_``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWSettings:
    """One step's hyperparameters, the same for every worker of the stack."""

    lr: float
    beta1: float
    beta2: float
    eps: float


def _per_worker(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [W] vector shaped to broadcast over a stacked [W, ...] tensor."""
    return values.view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def clip_stacked(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale each worker's gradient (its slice of every stacked tensor) to a total 2-norm of at most
    ``max_norm``, as ``clip_grad_norm_`` does for one model; returns the W norms before clipping."""
    # Each worker's norm is reduced as clip_grad_norm_ reduces one model's: tensor by tensor, then over tensors.
    # A row-wise norm of the stacked tensors is faster but can differ in the last bit, which lets workers drift.
    workers = grads[0].size(0)
    total = torch.stack(
        [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g[k]) for g in grads])) for k in range(workers)]
    )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(_per_worker(scale, g))
    return total


@torch.no_grad()
def adamw_stacked(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    weight_decay: Sequence[float],
    settings: AdamWSettings,
    scratch: Sequence[torch.Tensor] | None = None,
) -> None:
    """One AdamW step (decoupled weight decay, bias-corrected moments) on stacked tensors, in place.

    ``step`` is the step number being taken (1 for the first); ``weight_decay`` has one entry per tensor;
    ``scratch``, tensors shaped like ``params`` for the denominators (saves allocating them every step).
    The operations are those of torch's single-tensor AdamW, element by element.
    """
    lr, beta1, beta2, eps = settings.lr, settings.beta1, settings.beta2, settings.eps
    step_size = lr / (1 - beta1**step)
    correction2 = (1 - beta2**step) ** 0.5
    buffers = scratch if scratch is not None else [torch.empty_like(p) for p in params]
    for param, grad, exp_avg, exp_avg_sq, decay, denom in zip(
        params, grads, exp_avgs, exp_avg_sqs, weight_decay, buffers, strict=True
    ):
        if decay != 0:
            param.mul_(1 - lr * decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.sqrt(exp_avg_sq, out=denom).div_(correction2).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
