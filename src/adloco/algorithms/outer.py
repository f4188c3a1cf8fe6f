"""Pseudo-gradients and outer optimizers (DiLoCo, LocalSGD, DDP as special cases)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def worker_delta(global_params: Sequence[torch.Tensor], worker_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One worker's contribution θ − θ_m, in float32 (or the params' dtype when wider)."""
    return [(g - w.to(g.device)).to(_reduce_dtype(g)) for g, w in zip(global_params, worker_params, strict=True)]


def sum_in_order(contributions: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Sum per-worker tensor lists in the given order.

    The order is part of the result in floating point, so callers pass workers sorted by id: that is
    what makes one rank hosting M slots and M ranks hosting one slot each produce the same bits.
    """
    if not contributions:
        raise ValueError("no contributions to sum")
    total = [t.clone() for t in contributions[0]]
    for tensors in contributions[1:]:
        for acc, t in zip(total, tensors, strict=True):
            acc.add_(t)
    return total


def mean_in_order(contributions: Sequence[Sequence[torch.Tensor]], divisor: int | None = None) -> list[torch.Tensor]:
    """The contributions summed in the given order, divided by ``divisor`` (default: their count).

    With the workers' ``worker_delta`` in worker-id order this is the pseudo-gradient Δ = (1/M) Σ_m (θ − θ_m);
    a worker left out contributes zeros and is not counted in ``divisor``.
    """
    total = sum_in_order(contributions)
    return [t.div_(divisor or len(contributions)) for t in total]


def eager_pseudo_gradient(
    arrived: Sequence[torch.Tensor] | None,
    stale_share: Sequence[torch.Tensor] | None,
    fresh_share: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """Eager updates (arXiv 2502.12996): the stale mean Δ of the last round with this worker's own share in
    it replaced by its fresh one, ``arrived − stale_share + fresh_share``; ``None`` stands for zeros.

    The shares are what the worker contributed to the mean (its Δ_m divided by the number of workers
    averaged), so with one worker the result is exactly the fresh Δ and eager DiLoCo is DiLoCo.
    """
    parts = [arrived, stale_share, fresh_share]
    like = next((p for p in parts if p is not None), None)
    if like is None:
        raise ValueError("eager_pseudo_gradient needs at least one of its three terms")
    out = [torch.zeros_like(t) for t in like] if arrived is None else [t.clone() for t in arrived]
    for sign, share in ((-1.0, stale_share), (1.0, fresh_share)):
        if share is not None:
            for acc, t in zip(out, share, strict=True):
                acc.add_(t, alpha=sign)
    return out


def _reduce_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]  # params -> any torch optimizer


def adam_factory(lr: float, betas: tuple[float, float], eps: float) -> OuterFactory:
    """Outer Adam: torch's Adam (no weight decay) with the pseudo-gradient as its gradient."""
    return lambda params: torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, foreach=False)


ElementState = dict[tuple[int, str], torch.Tensor]  # (parameter position, state name) -> a tensor shaped like it


class OuterOptimizer:
    """SGD (optionally Nesterov) on the global parameters θ, driven by pseudo-gradients, or any torch optimizer
    a ``factory`` makes for the parameters (the pseudo-gradient is handed to it as the gradient).

    With lr 1 and no momentum the step sets θ to the workers' mean (LocalSGD). Parameters that receive
    no pseudo-gradient in a step keep their state untouched (their grad stays None, never zero).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        factory: OuterFactory | None = None,
    ):
        self.params = list(params)
        if factory is not None:
            self.optimizer = factory(self.params)
            return
        self.optimizer = torch.optim.SGD(
            self.params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, foreach=False
        )

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor | None]) -> None:
        for param, d in zip(self.params, delta, strict=True):
            param.grad = None if d is None else d.to(param.device, param.dtype)
        self.optimizer.step()
        for param in self.params:
            param.grad = None

    def momentum_buffers(self) -> list[torch.Tensor | None]:
        """Outer SGD's momentum per parameter (None before its first step or without momentum)."""
        return [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in self.params]

    def element_state(self) -> ElementState:
        """Every state tensor shaped like its parameter (SGD's momentum, Adam's two moments): what merging
        trainers averages and mirroring sends as tensors. The rest (step counts) is ``scalar_state``."""
        return {
            (i, name): value
            for i, p in enumerate(self.params)
            for name, value in self.optimizer.state.get(p, {}).items()
            if _per_element(name, value, p)
        }

    def scalar_state(self) -> dict[int, dict]:
        """Per parameter position, the state entries that are not per-element tensors (Adam's step count)."""
        return {
            i: {n: v.clone() if torch.is_tensor(v) else v for n, v in state.items() if not _per_element(n, v, p)}
            for i, p in enumerate(self.params)
            if (state := self.optimizer.state.get(p))
        }

    def load_element_state(self, tensors: ElementState, scalars: dict[int, dict]) -> None:
        """Replace the state with copies of ``tensors`` and ``scalars``; a parameter with neither has none."""
        for i, p in enumerate(self.params):
            entries = {name: t.clone() for (j, name), t in tensors.items() if j == i}
            entries.update(scalars.get(i, {}))
            if entries:
                self.optimizer.state[p] = entries
            else:
                self.optimizer.state.pop(p, None)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _per_element(name: str, value: object, param: torch.Tensor) -> bool:
    """A tensor shaped like its parameter (a scalar parameter's momentum too), except a step count."""
    return torch.is_tensor(value) and value.shape == param.shape and name != "step"
