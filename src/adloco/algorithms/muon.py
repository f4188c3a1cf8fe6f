"""Muon's update (Jordan et al. 2024; torch.optim.Muon's math): momentum, Newton–Schulz orthogonalization of each
2-D matrix, an lr matched to AdamW's update RMS (Moonshot, arXiv 2502.16982) and decoupled weight decay.

The orthogonalization runs in a dtype of the caller's choosing. torch's own Muon always runs it in bfloat16, which
is right on accelerators, but CPUs without bfloat16 units emulate those matmuls: 6.3 ms against 0.27 ms in float32
for one iteration on a 128×352 matrix here (docs/optimizers.md). In bfloat16 the operations below are torch's
one for one, so the result is torch.optim.Muon's bit for bit (tests/algorithms/test_muon.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c: steepest slope at zero (Jordan's)
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(
    matrix: torch.Tensor, dtype: torch.dtype = torch.float32, steps: int = NS_STEPS, eps: float = NS_EPS
) -> torch.Tensor:
    """An approximation of U Vᵀ for matrix = U S Vᵀ (singular values pushed to about 0.7–1.2), in ``dtype``."""
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalizes 2-D matrices, got shape {tuple(matrix.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: the Gram matrix is the smaller one
    x.div_(x.norm().clamp(min=eps))  # spectral norm ≤ Frobenius norm ≤ 1
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def rms_matched_lr(lr: float, shape: torch.Size | Sequence[int]) -> float:
    """Moonshot's scaling: an orthogonal update times 0.2·√max(A, B) has about AdamW's per-element RMS."""
    return lr * (0.2 * math.sqrt(max(shape[0], shape[1])))


@torch.no_grad()
def muon_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool = True,
    dtype: torch.dtype = torch.float32,
) -> None:
    """One Muon step in place: B ← μB + (1 − μ)g (torch's lerp form), the update g + μ(B − g) with Nesterov,
    orthogonalized, then θ ← θ(1 − lr·λ) − lr_rms·O."""
    for param, grad, buffer in zip(params, grads, momentum_buffers, strict=True):
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if nesterov else buffer
        orthogonal = orthogonalize(update, dtype)
        param.mul_(1 - lr * weight_decay)
        param.add_(orthogonal, alpha=-rms_matched_lr(lr, param.shape))
