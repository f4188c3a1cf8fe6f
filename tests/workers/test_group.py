"""Workers stacked into one computation keep every worker's numbers: forward, gradients, AdamW, clipping, state."""

import copy

import pytest
import torch

from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.models.build import build_model, classification_loss, next_token_loss, preset_config
from adloco.models.stacked import StackedLlama, unsupported_reason
from adloco.workers.group import WorkerGroup, stacking_blocker
from adloco.workers.worker import Worker

# The promise of docs/results/throughput.md: each worker's numbers equal its one-by-one numbers within this tolerance
# (on the CPUs we ran, they were bit-identical).
RTOL, ATOL = 1e-5, 1e-7
CONTEXT = 16


def _config(kv_heads: int = 4):
    config = preset_config("tiny", 256, context=CONTEXT)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 32, 64, 2
    config.num_key_value_heads = kv_heads
    return config


def _workers(count: int, inner: InnerConfig | None = None, kv_heads: int = 4, precision: str = "fp32") -> list[Worker]:
    tokens = torch.randint(0, 256, (6000,), generator=torch.Generator().manual_seed(1))
    return [
        Worker(
            k,
            build_model(_config(kv_heads), seed=k),
            inner or InnerConfig(),
            TokenStream(tokens, CONTEXT, 10 + k),
            precision=precision,
        )
        for k in range(count)
    ]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_stacked_forward_gives_each_model_its_own_loss_and_gradient(kv_heads):
    models = [build_model(_config(kv_heads), seed=k) for k in range(3)]
    params = [torch.stack(ps).detach().requires_grad_() for ps in zip(*(m.parameters() for m in models), strict=True)]
    tokens = torch.randint(0, 256, (3, 4, CONTEXT + 1), generator=torch.Generator().manual_seed(2))
    losses = StackedLlama(models[0]).losses(params, tokens[..., :-1], tokens[..., 1:])
    losses.sum().backward()
    for k, model in enumerate(models):
        loss = next_token_loss(model, tokens[k, :, :-1], tokens[k, :, 1:])
        loss.backward()
        assert _close(losses[k].detach(), loss.detach())
        for p, stacked in zip(model.parameters(), params, strict=True):
            assert _close(stacked.grad[k], p.grad)


def test_what_cannot_be_stacked_is_named():
    from transformers import LlamaForSequenceClassification

    tied = _config()
    tied.tie_word_embeddings = True
    assert "ties" in unsupported_reason(build_model(tied, 0), next_token_loss)
    assert "next-token" in unsupported_reason(build_model(_config(), 0), classification_loss)
    classifier = LlamaForSequenceClassification(_config())
    assert "not a LLaMA causal LM" in unsupported_reason(classifier, next_token_loss)
    assert "one worker" in stacking_blocker(_workers(1))
    mixed = _workers(2)
    mixed[1].precision = "bf16"
    assert "precision" in stacking_blocker(mixed)
    with pytest.raises(ValueError, match="cannot be stacked"):
        WorkerGroup(mixed)


def _train(workers, group, steps, samples, b_max, lrs):
    for _ in range(steps):
        if group is not None:
            results = group.compute_gradients(samples, b_max)
            assert group.step(lrs)
        else:
            results = [w.compute_gradients(samples, b_max) for w in workers]
            for worker, lr in zip(workers, lrs, strict=True):
                worker.step(lr)
    return results


def _assert_same_workers(grouped, alone):
    for a, b in zip(grouped, alone, strict=True):
        for p, q in zip(a.params, b.params, strict=True):
            assert _close(p.detach(), q.detach())
        state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert state_a.keys() == state_b.keys()
        for i in state_b:
            assert state_a[i].keys() == state_b[i].keys()  # AdamW's step and moments, or Muon's momentum
            for key in state_b[i]:
                assert _close(state_a[i][key], state_b[i][key])


def test_a_group_trains_each_worker_as_it_would_alone():
    """Micro-batches (5 samples at b_max 2), clipping that bites, weight decay: five steps of three workers."""
    inner = InnerConfig(clip=0.05, weight_decay=0.1)
    grouped, alone = _workers(3, inner), _workers(3, inner)
    group = WorkerGroup(grouped)
    results = _train(grouped, group, 5, samples=5, b_max=2, lrs=[3e-3] * 3)
    reference = _train(alone, None, 5, samples=5, b_max=2, lrs=[3e-3] * 3)
    for mine, theirs in zip(results, reference, strict=True):
        assert mine.finite and mine.samples == theirs.samples and mine.tokens == theirs.tokens
        assert mine.loss == pytest.approx(theirs.loss, rel=RTOL)
    _assert_same_workers(grouped, alone)
    moved = [
        float((p.detach() - q.detach()).abs().max()) for p, q in zip(grouped[0].params, grouped[1].params, strict=True)
    ]
    assert max(moved) > 0  # the workers stayed apart: each read its own stream and started from its own init


def test_a_group_of_muon_workers_steps_each_as_it_would_alone_and_through_a_resume():
    """inner.optimizer=muon: the stacked AdamW on embeddings, head and norms, each worker's own Muon on its views of
    the hidden matrices; a resumed state is taken over by the group as AdamW's is."""
    inner = InnerConfig(optimizer="muon", clip=0.05, muon_lr=2e-3)
    grouped, alone = _workers(3, inner), _workers(3, inner)
    group = WorkerGroup(grouped)
    _train(grouped, group, 3, samples=3, b_max=2, lrs=[3e-3] * 3)
    _train(alone, None, 3, samples=3, b_max=2, lrs=[3e-3] * 3)
    _assert_same_workers(grouped, alone)
    saved = [w.state_dict() for w in alone]
    assert any("momentum_buffer" in s for s in saved[0]["optimizer"]["state"].values())
    for grouped_worker, alone_worker, state in zip(grouped, alone, saved, strict=True):
        grouped_worker.load_state_dict(copy.deepcopy(state))  # torch's load keeps the given tensors: one each
        alone_worker.load_state_dict(state)
    _train(grouped, group, 2, samples=3, b_max=2, lrs=[3e-3] * 3)
    _train(alone, None, 2, samples=3, b_max=2, lrs=[3e-3] * 3)
    _assert_same_workers(grouped, alone)


def test_a_group_steps_one_by_one_where_its_workers_differ_and_picks_up_after():
    """Different lrs and a resumed optimizer state: the group declines the shared update, the workers step alone
    on the group's views, and later shared steps continue from exactly that state. A reset worker (step count 0
    among workers at 3) still steps with the group."""
    grouped, alone = _workers(2), _workers(2)
    group = WorkerGroup(grouped)
    _train(grouped, group, 2, samples=3, b_max=3, lrs=[1e-3, 1e-3])
    _train(alone, None, 2, samples=3, b_max=3, lrs=[1e-3, 1e-3])

    group.compute_gradients(3, 3)
    assert not group.step([1e-3, 2e-3])  # unequal lrs: nothing changed, the workers step one by one
    for worker, lr in zip(grouped, [1e-3, 2e-3], strict=True):
        worker.step(lr)
    _train(alone, None, 1, samples=3, b_max=3, lrs=[1e-3, 2e-3])

    saved = [w.state_dict() for w in alone]

    grouped[1].reset_optimizer()
    alone[1].reset_optimizer()
    group.compute_gradients(3, 3)
    assert group.step([1e-3, 1e-3])  # step counts differ now: each worker takes its own bias correction
    _train(alone, None, 1, samples=3, b_max=3, lrs=[1e-3, 1e-3])
    _assert_same_workers(grouped, alone)
    assert [float(s["step"]) for s in (w.optimizer.state[w.params[0]] for w in grouped)] == [4.0, 1.0]

    for grouped_worker, alone_worker, state in zip(grouped, alone, saved, strict=True):
        grouped_worker.load_state_dict(state)  # a resume replaces the optimizer's tensors; the group takes them over
        alone_worker.load_state_dict(state)
    _train(grouped, group, 2, samples=3, b_max=3, lrs=[1e-3, 1e-3])
    _train(alone, None, 2, samples=3, b_max=3, lrs=[1e-3, 1e-3])
    _assert_same_workers(grouped, alone)


def test_a_saved_worker_state_does_not_alias_the_group():
    workers = _workers(2)
    group = WorkerGroup(workers)
    _train(workers, group, 1, samples=2, b_max=2, lrs=[1e-3, 1e-3])
    saved = workers[0].state_dict()
    before = saved["optimizer"]["state"][0]["exp_avg"].clone()
    _train(workers, group, 1, samples=2, b_max=2, lrs=[1e-3, 1e-3])
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], before)
    assert saved["optimizer"]["state"][0]["exp_avg"].untyped_storage().nbytes() == before.numel() * 4


def test_out_of_memory_in_the_stacked_step_takes_the_same_samples_one_worker_at_a_time(monkeypatch):
    grouped, alone = _workers(2), _workers(2)
    group = WorkerGroup(grouped)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(group, "losses", no_room)
    results = group.compute_gradients(4, 4)
    assert not group.fits  # the cluster computes these workers one by one from now on
    reference = [w.compute_gradients(4, 4) for w in alone]
    for worker, other, mine, theirs in zip(grouped, alone, results, reference, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=RTOL)
        for p, q in zip(worker.params, other.params, strict=True):
            assert _close(p.grad, q.grad)


@pytest.mark.parametrize("gram", [False, True])
def test_a_statistics_step_gives_each_worker_its_own_statistics_and_gradient(gram):
    grouped, alone = _workers(2), _workers(2)
    results = WorkerGroup(grouped).compute_gradients(6, 2, stats_groups=3, gram=gram)
    reference = [w.compute_gradients(6, 2, stats_groups=3, gram=gram) for w in alone]
    for worker, other, mine, theirs in zip(grouped, alone, results, reference, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=RTOL)
        for field in ("samples", "grad_norm_sq", "sample_variance", "ip_variance", "orth_variance"):
            value, expected = getattr(mine.statistics, field), getattr(theirs.statistics, field)
            assert value == pytest.approx(expected, rel=RTOL) if expected is not None else value is None
        for p, q in zip(worker.params, other.params, strict=True):
            assert _close(p.grad, q.grad)
    assert results[0].statistics.sample_variance != results[1].statistics.sample_variance


def test_fp16_workers_of_a_group_keep_their_own_loss_scales():
    """One worker's scale is far too large: only that worker backs off, the step is computed again on the same
    samples, and every worker ends where it would alone."""
    grouped, alone = _workers(2, precision="fp16"), _workers(2, precision="fp16")
    for workers in (grouped, alone):
        workers[0].loss_scale.scale = 2.0**40  # float16 activation gradients overflow at this scale
    group = WorkerGroup(grouped)
    results = _train(grouped, group, 2, samples=4, b_max=2, lrs=[1e-3, 1e-3])
    reference = _train(alone, None, 2, samples=4, b_max=2, lrs=[1e-3, 1e-3])
    assert all(r.finite for r in results)
    for mine, theirs in zip(results, reference, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=RTOL)
    assert grouped[0].loss_scale.scale < 2.0**40 and grouped[1].loss_scale.scale == 2.0**16
    for mine, theirs in zip(grouped, alone, strict=True):
        assert mine.loss_scale == theirs.loss_scale
    _assert_same_workers(grouped, alone)
