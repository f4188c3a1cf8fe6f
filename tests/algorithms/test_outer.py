"""test vectors 1–4 of docs/design.md: the outer step reduces to known single-process optimizers."""

import pytest
import torch

from adloco.algorithms.outer import (
    OuterOptimizer,
    adam_factory,
    eager_pseudo_gradient,
    mean_in_order,
    worker_delta,
)

F64 = torch.float64


def pseudo_gradient(theta, workers):
    """Δ = (1/M) Σ_m (θ − θ_m) from the two functions the exchange uses: per-worker drifts, ordered mean."""
    return mean_in_order([worker_delta(theta, w) for w in workers])


def _problem(seed: int = 0):
    """A least-squares problem with 16 samples: per-sample loss ½(xᵀw − y)²."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 5, generator=g, dtype=torch.float64)
    y = torch.randn(16, generator=g, dtype=torch.float64)
    w0 = torch.randn(5, generator=g, dtype=torch.float64)
    return x, y, w0


def _grad(w, x, y):
    return x.T @ (x @ w - y) / len(y)


def _diloco(w0, x, y, inner_lr, outer_lr, momentum, nesterov, workers=4, inner_steps=1, rounds=20):
    theta = [w0.clone()]
    outer = OuterOptimizer(theta, lr=outer_lr, momentum=momentum, nesterov=nesterov)
    shards = torch.arange(len(y)).chunk(workers)
    for _ in range(rounds):
        finals = []
        for shard in shards:
            w = theta[0].clone()
            for _ in range(inner_steps):
                w = w - inner_lr * _grad(w, x[shard], y[shard])
            finals.append([w])
        outer.step(pseudo_gradient(theta, finals))
    return theta[0]


def test_vector1_h1_plain_outer_equals_big_batch_sgd():
    x, y, w0 = _problem()
    got = _diloco(w0, x, y, inner_lr=0.1, outer_lr=1.0, momentum=0.0, nesterov=False)
    w = w0.clone()
    for _ in range(20):
        w = w - 0.1 * _grad(w, x, y)
    assert torch.allclose(got, w, atol=1e-12, rtol=0)
    assert not torch.allclose(got, w0)


def test_vector2_h1_nesterov_outer_equals_nesterov_sgd():
    x, y, w0 = _problem(1)
    gamma, eta, mu = 0.05, 0.7, 0.9
    got = _diloco(w0, x, y, inner_lr=gamma, outer_lr=eta, momentum=mu, nesterov=True)
    w = w0.clone().requires_grad_(False)
    reference = [w]
    opt = torch.optim.SGD(reference, lr=gamma * eta, momentum=mu, nesterov=True)
    for _ in range(20):
        reference[0].grad = _grad(reference[0], x, y)
        opt.step()
    assert torch.allclose(got, reference[0], atol=1e-12, rtol=0)


def test_vector3_scalar_nesterov_sequence():
    theta = [torch.zeros(1, dtype=F64)]
    outer = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    seen = []
    for _ in range(3):
        outer.step([torch.ones(1, dtype=F64)])
        seen.append(float(theta[0]))
    assert seen == pytest.approx([-1.33, -3.227, -5.6343], abs=1e-12)


def test_vector4_localsgd_is_the_mean_of_workers():
    x, y, w0 = _problem(2)
    theta = [w0.clone()]
    outer = OuterOptimizer(theta, lr=1.0, momentum=0.0)
    shards = torch.arange(16).chunk(4)
    finals = []
    for shard in shards:  # H = 7 inner steps of a non-SGD optimizer: the result must still be the mean
        w = w0.clone().requires_grad_(True)
        opt = torch.optim.Adam([w], lr=0.05)
        for _ in range(7):
            opt.zero_grad()
            (0.5 * ((x[shard] @ w - y[shard]) ** 2).mean()).backward()
            opt.step()
        finals.append([w.detach()])
    outer.step(pseudo_gradient(theta, finals))
    mean = torch.stack([f[0] for f in finals]).mean(0)
    assert torch.allclose(theta[0], mean, atol=1e-12, rtol=0)


def test_outer_step_leaves_params_without_delta_untouched():
    theta = [torch.ones(3), torch.ones(2)]
    outer = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    outer.step([torch.ones(3), torch.ones(2)])
    before = [t.clone() for t in theta]
    momentum_before = [m.clone() for m in outer.momentum_buffers()]
    outer.step([torch.ones(3), None])
    assert torch.equal(theta[1], before[1])
    assert torch.equal(outer.momentum_buffers()[1], momentum_before[1])
    assert not torch.equal(theta[0], before[0])


def test_eager_pseudo_gradient_swaps_the_own_stale_share_for_the_fresh_one():
    # Two workers, scalar: last round's mean (2 + 4)/2 = 3 held worker 0's share 2/2; its fresh Δ is 6.
    arrived, stale, fresh = [torch.tensor([3.0])], [torch.tensor([1.0])], [torch.tensor([3.0])]
    assert eager_pseudo_gradient(arrived, stale, fresh)[0].item() == (4.0 + 6.0) / 2


def test_eager_pseudo_gradient_with_one_worker_is_the_fresh_delta_bit_for_bit():
    torch.manual_seed(0)
    old, new = [torch.randn(5, 3)], [torch.randn(5, 3)]
    out = eager_pseudo_gradient(old, [old[0] / 1], [new[0] / 1])
    assert torch.equal(out[0], new[0])


def test_eager_pseudo_gradient_first_round_and_failed_worker():
    fresh = [torch.tensor([0.5, -1.0])]
    assert torch.equal(eager_pseudo_gradient(None, None, fresh)[0], fresh[0])
    # A worker left out of this round contributes no fresh share: only the others' stale mean remains.
    arrived, stale = [torch.tensor([3.0, 3.0])], [torch.tensor([1.0, 2.0])]
    assert torch.equal(eager_pseudo_gradient(arrived, stale, None)[0], torch.tensor([2.0, 1.0]))
    with pytest.raises(ValueError):
        eager_pseudo_gradient(None, None, None)


def test_outer_adam_is_torch_adam_on_the_pseudo_gradient_and_its_state_moves_whole():
    """An outer lr above 1 is allowed; the state split into per-element tensors and step counts rebuilds an
    optimizer that steps on exactly as the original does."""
    theta, reference = [torch.zeros(3), torch.ones(2)], [torch.zeros(3), torch.ones(2)]
    outer = OuterOptimizer(theta, lr=2.0, factory=adam_factory(2.0, (0.8, 0.9), 1e-8))
    adam = torch.optim.Adam(reference, lr=2.0, betas=(0.8, 0.9), eps=1e-8, foreach=False)
    deltas = [[torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25])], [torch.ones(3), torch.zeros(2)]]
    for delta in deltas:
        outer.step(delta)
        for p, d in zip(reference, delta, strict=True):
            p.grad = d.clone()
        adam.step()
    assert all(torch.equal(a, b) for a, b in zip(theta, reference, strict=True))
    tensors, scalars = outer.element_state(), outer.scalar_state()
    assert sorted(tensors) == [(0, "exp_avg"), (0, "exp_avg_sq"), (1, "exp_avg"), (1, "exp_avg_sq")]
    assert float(scalars[0]["step"]) == 2.0
    copy = [t.clone() for t in theta]
    rebuilt = OuterOptimizer(copy, lr=2.0, factory=adam_factory(2.0, (0.8, 0.9), 1e-8))
    rebuilt.load_element_state(tensors, scalars)
    outer.step(deltas[0])
    rebuilt.step(deltas[0])
    assert all(torch.equal(a, b) for a, b in zip(theta, copy, strict=True))


def test_a_scalar_parameters_momentum_is_per_element_state_and_a_step_count_is_not():
    theta = [torch.tensor(1.0), torch.ones(2)]
    sgd = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    sgd.step([torch.tensor(0.5), torch.ones(2)])
    assert sorted(sgd.element_state()) == [(0, "momentum_buffer"), (1, "momentum_buffer")]
    adam = OuterOptimizer(theta, lr=0.1, factory=adam_factory(0.1, (0.9, 0.95), 1e-8))
    adam.step([torch.tensor(0.5), torch.ones(2)])
    assert (0, "step") not in adam.element_state() and float(adam.scalar_state()[0]["step"]) == 1.0
