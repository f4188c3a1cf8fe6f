"""The inner optimizer a worker steps: AdamW, or Muon on the hidden matrices with AdamW on the rest (MuLoCo,
arXiv 2505.23725), as one ``torch.optim.Optimizer`` a user's loop, the HF ``Trainer`` or Lightning can hold too.

Muon orthogonalizes each 2-D weight's momentum (Newton–Schulz) and so only fits matrices that map hidden features
to hidden features: embeddings, the output head and every vector (norms, biases) stay with AdamW, as Muon's
authors and torch's documentation prescribe. Its learning rate follows Moonshot's RMS matching
(``adjust_lr_fn="match_rms_adamw"``: the update is scaled to AdamW's typical size), so one lr, one schedule and
one weight decay serve both halves; ``muon_lr`` sets Muon's apart when wanted. The Muon here is torch's math with
the orthogonalization's dtype chosen per device (``adloco.algorithms.muon``), and needs no torch >= 2.9.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from adloco.algorithms.muon import muon_step
from adloco.config import InnerConfig

_HEAD_NAMES = ("lm_head", "score", "classifier")  # the output layers of HF causal-LM and classification models


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's trainable 2-D weights other than embeddings and the output head, in parameter order."""
    excluded: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) or name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            excluded.update(id(p) for p in module.parameters(recurse=False))
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        excluded.update(id(p) for p in output.parameters())
    return [p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in excluded]


class Muon(torch.optim.Optimizer):
    """Muon (``adloco.algorithms.muon``) for 2-D matrices, its Newton–Schulz in ``ns_dtype`` (default: bfloat16
    on CUDA as torch's Muon, float32 elsewhere, where bfloat16 matmuls are emulated and 20x slower)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon steps 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "ns_dtype": self.ns_dtype}  # torch keeps defaults, state and groups only

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            if not params:
                continue
            dtype = self.ns_dtype or (torch.bfloat16 if params[0].device.type == "cuda" else torch.float32)
            muon_step(
                params,
                [p.grad for p in params],
                [self.state[p]["momentum_buffer"] for p in params],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                dtype=dtype,
            )
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``matrices``, AdamW on every other parameter of ``params``, stepped as one optimizer.

    Its parameter groups are Muon's followed by AdamW's (the very dicts the two hold, so an lr schedule or a
    batch coupling that edits a group edits the optimizer that steps it) and the two share one state, so
    ``state_dict``, ``load_state_dict``, hooks and ``zero_grad`` are torch's own. AdamW's weight decay applies to
    its 2-D weights only (embeddings, head), as adloco's plain AdamW does. ``muon_lr``: Muon's lr (default: ``lr``,
    RMS-matched to AdamW's update size); ``ns_dtype``: the orthogonalization's dtype (default: per device).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        matrices: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        muon_lr: float | None = None,
        muon_momentum: float = 0.95,
        adamw_options: dict[str, Any] | None = None,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        matrices = list(matrices)
        if not matrices:
            raise ValueError("Muon found no hidden matrices in this model (2-D weights besides embeddings and head)")
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        muon_lr = lr if muon_lr is None else muon_lr
        self.muon = Muon(
            [{"params": matrices, "lr": muon_lr, "lr_scale": muon_lr / lr if lr else 1.0}],
            lr=muon_lr,
            weight_decay=weight_decay,
            momentum=muon_momentum,
            ns_dtype=ns_dtype,
        )
        self.adamw = torch.optim.AdamW(
            decay_matrices_only(rest, weight_decay),
            lr=lr,
            betas=betas,
            eps=eps,
            **(adamw_options or {}),
        )
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._share()
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):  # a group added here would belong to neither half and never step
            raise ValueError("MuonWithAdamW cannot take new parameter groups: build a new one over all the parameters")
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "muon": self.muon, "adamw": self.adamw, "_built": True}

    def _share(self) -> None:
        """Point the two optimizers at this one's groups and state (again after a load replaced them)."""
        count = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:count], self.param_groups[count:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = _closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:
            self._share()


def decay_matrices_only(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups: weight decay on the 2-D weights, none on norms and biases."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _closure_loss(closure: Any) -> Any:
    """What torch optimizers do with a ``closure``: evaluate it with gradients on, before the step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def inner_optimizer(model: torch.nn.Module, inner: InnerConfig, adamw_options: dict[str, Any]) -> torch.optim.Optimizer:
    """A worker's inner optimizer from the config's ``inner`` section (weight decay on matrices only)."""
    params = list(model.parameters())
    if inner.optimizer == "muon":
        return MuonWithAdamW(
            params,
            hidden_matrices(model),
            lr=inner.lr,
            weight_decay=inner.weight_decay,
            betas=(inner.beta1, inner.beta2),
            eps=inner.eps,
            muon_lr=inner.muon_lr,
            muon_momentum=inner.muon_momentum,
            adamw_options=adamw_options,
        )
    return torch.optim.AdamW(
        decay_matrices_only(params, inner.weight_decay),
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
        **adamw_options,
    )


def set_inner_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr for this step: ``lr``, times Muon's own ratio to it where the group has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The groups AdamW steps (those with betas): what β2 coupling and a stacked AdamW update act on."""
    return [group for group in optimizer.param_groups if "betas" in group]
