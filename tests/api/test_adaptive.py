"""AdLoCo's adaptive batch in a user's loop (``DiLoCo(method="adloco").batch``): the batch it asks for, the
statistics from the loop's own loss, lr/β2 following b, its sampler and its state. Its decisions against
``adloco train``'s, bit for bit under torchrun, are in test_diloco.py."""

import io
import math

import pytest
import torch

from adloco import DiLoCo
from adloco.config import ConfigError

PINNED = {"size": 1, "b_cap": 16, "time": {"step_seconds": [0.01, 0.001], "round_seconds": 0.05, "min_steps_left": 1}}
DATA = torch.randn(4096, 4, generator=torch.Generator().manual_seed(0))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _loss(model):
    return lambda x: torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())


def _run(diloco, model, optimizer, steps: int, sampler=None) -> list[int]:
    """``steps`` inner steps reading what the batch asks for; the b of each step."""
    batches = iter(sampler or diloco.batch.sampler(len(DATA), seed=1))
    sizes = []
    for _ in range(steps):
        indices = next(batches)
        sizes.append(diloco.batch.size)
        optimizer.zero_grad()
        diloco.batch.backward(_loss(model), DATA[indices])
        optimizer.step()
    return sizes


def test_the_time_aware_batch_grows_from_the_loops_own_loss_at_most_2x_per_round():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    with DiLoCo(model, optimizer, sync_every=2, method="adloco", batch=PINNED, total_samples=4096) as diloco:
        sizes = _run(diloco, model, optimizer, 24)[::2]  # one b per round
    assert sizes[0] == 1 and sizes[-1] > 1 and all(a <= b <= 2 * a for a, b in zip(sizes, sizes[1:], strict=False))
    decision = diloco.batch.last_decision
    assert decision["timed"]["step_seconds"] == pytest.approx(0.01 + 0.001 * decision["b_req"])
    # β2 keeps its memory in samples: 0.99 ** (b / b_start); the lr follows sqrt(b / b_start) (adloco's defaults)
    assert optimizer.param_groups[0]["betas"][1] == pytest.approx(0.99**diloco.batch.size)
    assert diloco.batch.lr_scale == pytest.approx(math.sqrt(diloco.batch.size))


def test_the_inner_lr_is_scaled_for_the_optimizer_step_only():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    optimizer.register_step_post_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    batch = {**PINNED, "size": 4, "scaling": {"lr": "linear"}}
    with DiLoCo(model, optimizer, sync_every=2, method="adloco", batch=batch) as diloco:
        _run(diloco, model, optimizer, 6)
        scale = diloco.batch.lr_scale
    assert scale != 1.0 and optimizer.param_groups[0]["lr"] == 1e-2  # the loop's own lr outside the step
    assert seen[-1] == pytest.approx(1e-2 * scale)


def test_a_statistics_step_gives_the_mean_gradient_and_its_statistics():
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    diloco = DiLoCo(model, optimizer, sync_every=4, method="adloco", batch={"size": 6, "statistics": {"groups": 3}})
    assert diloco.batch.measuring and diloco.batch.samples == 6
    diloco.batch.backward(_loss(model), DATA[:6])
    _loss(reference)(DATA[:6]).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    optimizer.step()  # the hooks are not on: step() tells DiLoCo
    diloco.step()
    statistics = diloco._state.local[0].statistics  # in the round's report, which the exchange carries
    assert statistics is not None and statistics.samples == 6 and statistics.sample_variance > 0
    assert not diloco.batch.measuring  # only the round's first step measures


def test_a_small_batch_reads_two_samples_on_its_statistics_step_and_micro_batches_cap_memory():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=2, method="adloco", batch={"size": 1})
    assert diloco.batch.samples == 2  # a variance needs two samples
    diloco.batch.backward(_loss(model), DATA[:2])
    diloco.step()
    assert diloco.batch.samples == 1
    capped = DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 7, "memory": {"b_max": 4}}
    )
    assert capped.batch.plan.sizes == (4,)  # switch mode: b_req ≤ 2·b_max runs one capped micro-batch
    split = DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 9, "memory": {"b_max": 4}}
    )
    assert split.batch.plan.sizes == (3, 3, 3)  # above it, micro-batches that sum to b_req


def test_the_sampler_reads_what_each_step_asks_for_over_shuffled_epochs():
    model = _model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 3})
    sampler = iter(diloco.batch.sampler(7, seed=5))
    first = next(sampler)
    assert len(first) == 3
    diloco.batch.first_step = False
    seen = first + [i for _ in range(3) for i in next(sampler)]
    assert sorted(seen[:7]) == list(range(7)) and len(seen) == 12  # an epoch is a permutation; the next follows


def test_a_run_resumed_mid_round_goes_on_bit_identically():
    def fresh():
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, DiLoCo(model, optimizer, sync_every=3, method="adloco", batch=PINNED)

    model, optimizer, diloco = fresh()
    with diloco:
        _run(diloco, model, optimizer, 20)
    expected = [t.clone() for t in diloco.theta]

    model, optimizer, diloco = fresh()
    with diloco:
        sampler = diloco.batch.sampler(len(DATA), seed=1)
        _run(diloco, model, optimizer, 10, iter(sampler))  # mid-round: 10 = 3·3 + 1
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": diloco.state_dict()}
    buffer = io.BytesIO()
    torch.save({**state, "sampler": sampler.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model, optimizer, resumed = fresh()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["diloco"])
    assert resumed.batch.size == diloco.batch.size > 1 and not resumed.batch.measuring
    sampler = resumed.batch.sampler(len(DATA), seed=1)
    sampler.load_state_dict(saved["sampler"])
    with resumed:
        _run(resumed, model, optimizer, 10, iter(sampler))
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed.theta, strict=True))


def test_what_a_users_loop_cannot_do_is_one_clear_error():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cross_worker"):
        DiLoCo(model, optimizer, 2, "adloco", batch={"statistics": {"estimator": "cross_worker"}})
    with pytest.raises(ConfigError, match="keep_round_time"):
        DiLoCo(model, optimizer, 2, "adloco", batch={"time": {"keep_round_time": True}})
    with pytest.raises(ConfigError, match="batch"):
        DiLoCo(model, optimizer, 2, "ddp", batch={"test": "norm"})
    with pytest.raises(ConfigError, match="step_seconds"):
        DiLoCo(model, optimizer, 2, "adloco", batch={"time": {"step_seconds": [[0.1, 0.01], [0.1, 0.01]]}})


def test_a_worker_absent_from_the_round_counts_no_samples_and_no_statistics():
    """A fault-tolerant replica missing from a round's exchange (its report the absent one) read nothing: the
    budget counts the present workers' samples only, and the batch test decides from theirs."""
    from adloco.workers.reports import RoundState, WorkerRound, absent_report

    model = _model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 3})
    absent = WorkerRound.from_tensor(absent_report(WorkerRound(steps=[]).to_tensor().numel()))
    assert absent.absent and absent.out and not WorkerRound(out=True).absent  # out of the round is not absent
    state = RoundState(index=1, steps=2, first_step=2, statistics_due=False, reports={0: absent})
    diloco.batch.round_steps = 2  # the round's steps, as stamp() sets them at its end
    diloco.batch.learn(state)
    assert diloco.batch.samples_done == 0
    state.reports = {0: WorkerRound()}
    diloco.batch.learn(state)
    assert diloco.batch.samples_done == 2 * 3
