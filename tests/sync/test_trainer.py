"""Where a trainer keeps θ and its outer state (outer.device), and that the place changes no number."""

import pytest
import torch

from adloco import DiLoCo
from adloco.errors import ConfigError
from adloco.sync.trainer import HOST_FROM_PARAMETERS, theta_device

CPU = torch.device("cpu")


def test_auto_keeps_large_models_state_in_host_memory_and_small_ones_beside_the_model():
    assert theta_device("auto", CPU, HOST_FROM_PARAMETERS - 1, user_loop=True) == CPU
    meta = torch.device("meta")  # stands for an accelerator: a small model's θ stays on its device
    assert theta_device("auto", meta, HOST_FROM_PARAMETERS - 1, user_loop=True) == meta
    assert theta_device("auto", meta, HOST_FROM_PARAMETERS, user_loop=True) == CPU
    assert theta_device("auto", meta, 10, user_loop=False) == CPU  # adloco train: always the host
    assert theta_device("cpu", meta, 10, user_loop=True) == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="outer.device: cuda was asked for but no CUDA device is available"):
        theta_device("cuda", CPU, 10, user_loop=True)


def _theta_after_rounds(outer: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    with DiLoCo(model, optimizer, sync_every=3, outer=outer) as diloco:
        for step in range(9):
            x = data[step * 4 : step * 4 + 4]
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [t.clone() for t in diloco.theta]


def test_the_place_of_the_outer_state_changes_no_bit():
    host = _theta_after_rounds({"device": "cpu"})
    beside = _theta_after_rounds({"device": "auto"})  # a small model: beside it (the CPU here)
    assert all(torch.equal(a, b) for a, b in zip(host, beside, strict=True))
    assert all(t.device == CPU for t in host)
