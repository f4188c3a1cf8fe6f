"""What a new user's own loop trips on, each refused or warned about in one line (issue 53, part 5): in one
process where ranks do not matter, on two gloo ranks (tests/api/pitfalls_loop.py) where they do."""

import pytest
import torch

from adloco import DiLoCo


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_finish_without_a_round_is_refused_instead_of_undoing_the_training():
    """A loop that never entered `with diloco:` nor called diloco.step(): finish() would set the model to the
    untrained θ; it refuses and leaves the trained model alone."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=2)
    _steps(model, optimizer, 4)  # trained, but DiLoCo saw none of it
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"no round ran: enter `with diloco:` or call `diloco.step\(\)`"):
        diloco.finish()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained, strict=True))
