"""Muon's step: torch.optim.Muon's numbers where the orthogonalization runs in bfloat16 as torch's does."""

import pytest
import torch

from adloco.algorithms.muon import muon_step, orthogonalize


def _matrices(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 20, generator=g), torch.randn(24, 6, generator=g)]  # wide and tall


def test_muon_in_bfloat16_is_torch_muon_bit_for_bit():
    ours, theirs = _matrices(0), _matrices(0)
    buffers = [torch.zeros_like(p) for p in ours]
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        grads = _matrices(10 + step)
        muon_step(ours, grads, buffers, lr=0.02, weight_decay=0.1, momentum=0.9, dtype=torch.bfloat16)
        for p, grad in zip(theirs, grads, strict=True):
            p.grad = grad
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
def test_orthogonalize_flattens_the_singular_values_in_float32(shape):
    """The quintic pushes every singular value into a band around 1 whatever their spread before (Jordan's
    coefficients trade exactness for speed: between about 0.5 and 1.5), keeping the singular vectors."""
    g = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g))
    k = min(shape)
    spread = torch.logspace(-1, 1, k)  # condition number 100
    matrix = u[:, :k] @ torch.diag(spread) @ v[:, :k].T
    result = orthogonalize(matrix, torch.float32)
    assert result.dtype == torch.float32 and result.shape == matrix.shape
    singular = torch.linalg.svdvals(result)
    assert float(singular.min()) > 0.5 and float(singular.max()) < 1.5
    overlap = torch.diag(u[:, :k].T @ result @ v[:, :k])  # the same directions, each scaled by about 1
    assert float(overlap.min()) > 0.5


def test_orthogonalize_takes_matrices_only():
    with pytest.raises(ValueError, match="2-D"):
        orthogonalize(torch.ones(3))
