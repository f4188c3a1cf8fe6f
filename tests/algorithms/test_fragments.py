"""Streaming DiLoCo fragments, schedule and mixing; test vector 7 of docs/design.md."""

import functools
import math

import pytest
import torch

from adloco.algorithms.fragments import assign_fragments, layer_index, mix
from adloco.algorithms.outer import OuterOptimizer, mean_in_order, worker_delta
from adloco.algorithms.schedules import (
    fragment_offsets,
    fragments_receiving_at,
    fragments_sending_at,
    validate_schedule,
)


def pseudo_gradient(theta, workers):
    """Δ = (1/M) Σ_m (θ − θ_m) from the two functions the exchange uses: per-worker drifts, ordered mean."""
    return mean_in_order([worker_delta(theta, w) for w in workers])


@functools.cache
def _names() -> tuple[str, ...]:
    from transformers import LlamaConfig, LlamaForCausalLM  # on use: collecting the suite skips its import

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    return tuple(n for n, _ in LlamaForCausalLM(config).named_parameters())


def test_layer_index():
    assert layer_index("model.layers.3.self_attn.q_proj.weight") == 3
    assert layer_index("model.layers.12.mlp.down_proj.weight") == 12
    assert layer_index("transformer.h.11.mlp.c_fc.weight") == 11
    assert layer_index("h.0.attn.weight") == 0
    assert layer_index("bert.encoder.layer.2.output.dense.bias") == 2
    assert layer_index("model.embed_tokens.weight") is None and layer_index("lm_head.weight") is None
    assert layer_index("model.norm.weight") is None
    assert layer_index("model.high.3.weight") is None  # "h" must be a whole name component
    assert layer_index("model.layers_extra.3.weight") is None


def test_llama_names_are_what_the_rule_expects():
    names = _names()
    outside = sorted(n for n in names if layer_index(n) is None)
    assert outside == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert sorted({layer_index(n) for n in names} - {None}) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["strided", "sequential"])
@pytest.mark.parametrize("shared", ["first", "own"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_every_parameter_in_exactly_one_fragment(mode, shared, count):
    names = _names()
    fits = count <= 4 if shared == "first" else 2 <= count <= 5
    if not fits:
        with pytest.raises(ValueError, match="does not fit a model with 4 blocks"):
            assign_fragments(names, count, mode, shared)
        return
    fragments = assign_fragments(names, count, mode, shared)
    assert len(fragments) == count and all(fragments)
    assert sorted(i for f in fragments for i in f) == list(range(len(names)))
    assert all(f == sorted(f) for f in fragments)  # model order inside a fragment
    outside = {i for i, n in enumerate(names) if layer_index(n) is None}
    assert outside <= set(fragments[0])
    if shared == "own":
        assert set(fragments[0]) == outside
    # a block is never split across fragments
    for block in range(4):
        holders = {p for p, f in enumerate(fragments) for i in f if layer_index(names[i]) == block}
        assert len(holders) == 1


def _blocks_of(names, fragments):
    return [sorted({layer_index(names[i]) for i in f} - {None}) for f in fragments]


def test_strided_and_sequential_place_blocks_differently():
    names = _names()
    assert _blocks_of(names, assign_fragments(names, 2, "strided")) == [[0, 2], [1, 3]]
    assert _blocks_of(names, assign_fragments(names, 2, "sequential")) == [[0, 1], [2, 3]]
    assert _blocks_of(names, assign_fragments(names, 3, "strided")) == [[0, 3], [1], [2]]
    assert _blocks_of(names, assign_fragments(names, 3, "sequential")) == [[0, 1], [2], [3]]
    # own: fragment 0 holds only embeddings, final norm and head; blocks are dealt over fragments 1..P-1
    assert _blocks_of(names, assign_fragments(names, 3, "strided", "own")) == [[], [0, 2], [1, 3]]


def test_own_without_outside_parameters_acts_like_first():
    names = [n for n in _names() if layer_index(n) is not None]
    assert assign_fragments(names, 4, shared="own") == assign_fragments(names, 4, shared="first")


def test_assignment_validation():
    names = _names()
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        assign_fragments(names, 0)
    with pytest.raises(ValueError, match="4 blocks"):
        assign_fragments(names, 5)
    with pytest.raises(ValueError, match="one fragment is taken by embeddings/head"):
        assign_fragments(names, 6, shared="own")
    with pytest.raises(ValueError, match="assignment"):
        assign_fragments(names, 2, mode="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared"):
        assign_fragments(names, 2, shared="last")  # type: ignore[arg-type]
    # a model without blocks can still run with a single fragment
    assert assign_fragments(["w", "b"], 1) == [[0, 1]]


def test_schedule_vectors():
    assert fragment_offsets(12, 3) == [0, 4, 8]
    assert fragment_offsets(10, 1) == [0]
    sends = {t: fragments_sending_at(t, 12, 3) for t in range(0, 30) if fragments_sending_at(t, 12, 3)}
    assert sends == {4: [1], 8: [2], 12: [0], 16: [1], 20: [2], 24: [0], 28: [1]}
    sends = {t: fragments_sending_at(t, 10, 2) for t in range(0, 30) if fragments_sending_at(t, 10, 2)}
    assert sends == {5: [1], 10: [0], 15: [1], 20: [0], 25: [1]}
    # P = 1: exactly DiLoCo's round boundaries, never at step 0
    assert [t for t in range(0, 40) if fragments_sending_at(t, 10, 1)] == [10, 20, 30]
    assert fragments_receiving_at(6, 12, 3, 2) == [1] and fragments_receiving_at(6, 12, 3, 0) == []
    assert fragments_receiving_at(2, 12, 3, 2) == []  # nothing was sent at step 0


@pytest.mark.parametrize(("h", "p", "tau"), [(12, 3, 0), (12, 3, 3), (10, 2, 4), (8, 8, 0), (6, 1, 5)])
def test_every_fragment_syncs_once_per_round_and_lands_tau_later(h, p, tau):
    validate_schedule(h, p, tau)
    steps = range(1, 5 * h + 1)
    sent = [(t, q) for t in steps for q in fragments_sending_at(t, h, p)]
    received = [(t, q) for t in steps for q in fragments_receiving_at(t, h, p, tau)]
    for q in range(p):
        times = [t for t, f in sent if f == q]
        assert times[0] == (q * h // p or h) and all(b - a == h for a, b in zip(times, times[1:], strict=False))
    assert received == [(t + tau, q) for t, q in sent if t + tau <= 5 * h]
    # τ < H/P: a fragment lands before the next fragment is sent, so at most one exchange is in flight
    for t, _ in sent:
        assert not any(t < s < t + tau for s, _ in sent)


@pytest.mark.parametrize(
    ("h", "p", "tau", "message"),
    [
        (10, 3, 0, r"sync_every \(10\) must be a multiple of streaming.fragments \(3\)"),
        (12, 3, 4, r"streaming.overlap \(4\) must be >= 0 and < sync_every/fragments \(4\)"),
        (12, 3, -1, r"streaming.overlap \(-1\)"),
        (12, 0, 0, r"streaming.fragments \(0\) must be >= 1"),
        (0, 1, 0, r"sync_every \(0\)"),
    ],
)
def test_schedule_validation(h, p, tau, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(h, p, tau)


def test_mix_is_exact_at_the_ends():
    local, outer = torch.randn(10), torch.randn(10)
    assert mix(local, outer, 0.0) is outer and mix(local, outer, 1.0) is local
    assert torch.allclose(mix(local, outer, 0.25), 0.25 * local + 0.75 * outer, atol=1e-7)
    assert torch.equal(mix(local, local.clone(), 0.3), local)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="alpha"):
            mix(local, outer, bad)


def test_pseudo_gradient_sums_in_worker_order():
    theta = [torch.zeros(1), torch.ones(2)]
    workers = [
        [torch.tensor([-1e8]), torch.zeros(2)],
        [torch.tensor([-1.0]), torch.ones(2)],
        [torch.tensor([1e8]), 2 * torch.ones(2)],
    ]
    delta = pseudo_gradient(theta, workers)
    # in order (1e8 + 1) − 1e8 = 0 in float32 (the 1 is lost); (1e8 − 1e8) + 1 keeps it
    assert delta[0].item() == 0.0 and delta[0].dtype == torch.float32
    assert torch.equal(delta[1], torch.zeros(2))
    assert pseudo_gradient(theta, [workers[0], workers[2], workers[1]])[0].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no contributions"):
        pseudo_gradient(theta, [])


def test_outer_step_on_one_fragment_leaves_the_others_bit_identical():
    """test vector 7 of docs/design.md, second half, with one torch SGD (Nesterov 0.7/0.9) per fragment."""
    torch.manual_seed(0)
    theta = [torch.randn(5, 3) for _ in range(6)]
    fragments = [[0, 2, 4], [1, 3, 5]]
    optimizers = [
        torch.optim.SGD([theta[i] for i in f], lr=0.7, momentum=0.9, nesterov=True, foreach=False) for f in fragments
    ]

    def outer_step(p, delta_scale):
        for i in fragments[p]:
            theta[i].grad = torch.full_like(theta[i], delta_scale)
        optimizers[p].step()
        for i in fragments[p]:
            theta[i].grad = None

    outer_step(0, 1.0)
    outer_step(1, -2.0)  # both fragments now carry momentum
    params_before = [t.clone() for t in theta]
    momentum_before = [optimizers[1].state[theta[i]]["momentum_buffer"].clone() for i in fragments[1]]
    outer_step(0, 0.5)
    for i in fragments[1]:
        assert theta[i].grad is None and torch.equal(theta[i], params_before[i])
    for i, buffer in zip(fragments[1], momentum_before, strict=True):
        assert torch.equal(optimizers[1].state[theta[i]]["momentum_buffer"], buffer)
    assert all(not torch.equal(theta[i], params_before[i]) for i in fragments[0])
    # Why None and not zero: a zero gradient would still move fragment 1 by its momentum and decay it.
    for i in fragments[1]:
        theta[i].grad = torch.zeros_like(theta[i])
    optimizers[1].step()
    assert not torch.equal(theta[1], params_before[1])


def _inner_step(params, target, t, lr=0.1):
    """A deterministic SGD step on ½‖w − target‖² plus a step-dependent push (stand-in for noisy data)."""
    for w, c in zip(params, target, strict=True):
        w.sub_(lr * (w - c + 0.05 * math.sin(t + float(c.sum()))))


def _diloco(theta0, targets, h, rounds):
    theta = [t.clone() for t in theta0]
    outer = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    workers = [[t.clone() for t in theta] for _ in targets]
    t = 0
    for _ in range(rounds):
        for _ in range(h):
            t += 1
            for w, c in zip(workers, targets, strict=True):
                _inner_step(w, c, t)
        outer.step(pseudo_gradient(theta, workers))
        for w in workers:
            for wp, tp in zip(w, theta, strict=True):
                wp.copy_(tp)
    return theta, outer.momentum_buffers()


def _streaming(theta0, targets, h, rounds, p, tau, alpha, shared="first"):
    names = ["embed.weight"] + [f"model.layers.{i // 2}.w{i % 2}" for i in range(len(theta0) - 1)]
    fragments = assign_fragments(names, p, "strided", shared)
    theta = [t.clone() for t in theta0]
    outers = [OuterOptimizer([theta[i] for i in f], lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    workers = [[t.clone() for t in theta] for _ in targets]
    in_flight: dict[int, list[torch.Tensor]] = {}
    for t in range(1, h * rounds + 1):
        for w, c in zip(workers, targets, strict=True):
            _inner_step(w, c, t)
        for q in fragments_sending_at(t, h, p):
            f = fragments[q]
            in_flight[q] = pseudo_gradient([theta[i] for i in f], [[w[i] for i in f] for w in workers])
        for q in fragments_receiving_at(t, h, p, tau):
            outers[q].step(in_flight.pop(q))
            for w in workers:
                for i in fragments[q]:
                    w[i].copy_(mix(w[i], theta[i], alpha))
    momentum = [None] * len(theta)
    for f, outer in zip(fragments, outers, strict=True):
        for i, m in zip(f, outer.momentum_buffers(), strict=True):
            momentum[i] = m
    return theta, momentum, in_flight


def test_streaming_with_one_fragment_no_overlap_no_mixing_is_diloco():
    """test vector 7 of docs/design.md, first half: P = 1, τ = 0, α = 0 reproduces DiLoCo bit for bit."""
    g = torch.Generator().manual_seed(1)
    theta0 = [torch.randn(4, 3, generator=g) for _ in range(5)]
    targets = [[torch.randn(4, 3, generator=g) for _ in range(5)] for _ in range(3)]
    expected, expected_momentum = _diloco(theta0, targets, h=5, rounds=4)
    got, momentum, in_flight = _streaming(theta0, targets, h=5, rounds=4, p=1, tau=0, alpha=0.0)
    assert not in_flight
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected_momentum, strict=True))
    # the comparison is sharp: streaming proper (P = 2, τ = 1, α = 0.5) lands elsewhere
    other, _, _ = _streaming(theta0, targets, h=6, rounds=4, p=2, tau=1, alpha=0.5)
    assert not all(torch.equal(a, b) for a, b in zip(other, expected, strict=True))


def test_a_model_without_transformer_blocks_is_split_by_its_top_level_modules():
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]  # an nn.Sequential
    assert assign_fragments(names, 2, "strided") == [[0, 1, 4, 5], [2, 3]]
    assert assign_fragments(names, 2, "sequential") == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="does not fit a model with 3 blocks"):
        assign_fragments(names, 4)
