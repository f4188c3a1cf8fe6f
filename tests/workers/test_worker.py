import copy

import pytest
import torch

from adloco.algorithms.switch import plan_micro_batches, split_evenly
from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.models.build import build_model, preset_config
from adloco.workers.worker import Worker, backward_in_micro_batches


class _Slot:
    """A worker with the b_max and switch factor its cluster would plan its steps with."""

    def __init__(self, b_max=64, switch_factor=2.0, seed=0):
        config = preset_config("tiny", 256, context=16)
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = 32, 64, 2
        model = build_model(config, 0)
        tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(1))
        self.worker = Worker(0, model, InnerConfig(), TokenStream(tokens, 16, seed))
        self.b_max, self.switch_factor = b_max, switch_factor
        self.params, self.model, self.stream = self.worker.params, self.worker.model, self.worker.stream

    def compute_gradients(self, b_req, **kwargs):
        samples = plan_micro_batches(b_req, self.b_max, self.switch_factor).samples
        return self.worker.compute_gradients(samples, self.b_max, **kwargs)


_worker = _Slot


def _grads(worker):
    return torch.cat([p.grad.reshape(-1) for p in worker.params])


def test_split_evenly():
    assert split_evenly(17, 3) == [6, 6, 5]
    assert split_evenly(4, 4) == [1, 1, 1, 1]


def test_accumulation_matches_one_big_batch():
    """Micro-batches weighted by sample count give the gradient of the whole batch."""
    whole, split = _worker(b_max=64), _worker(b_max=4, switch_factor=1.0)
    whole.compute_gradients(17)
    result = split.compute_gradients(17)
    assert result.samples == 17
    assert torch.allclose(_grads(whole), _grads(split), atol=1e-6, rtol=1e-4)


def test_capped_mode_reads_b_max_samples():
    worker = _worker(b_max=8, switch_factor=2.0)
    assert worker.compute_gradients(12).samples == 8  # b_max < b_req <= 2 b_max: one micro-batch of b_max
    assert worker.compute_gradients(17).samples == 17  # beyond n·b_max: accumulate to exactly b_req


def test_statistics_step_keeps_the_same_gradient():
    plain, grouped = _worker(), _worker()
    plain.compute_gradients(8)
    result = grouped.compute_gradients(8, stats_groups=4)
    assert result.statistics is not None and result.statistics.samples == 8
    assert result.statistics.sample_variance > 0
    assert torch.allclose(_grads(plain), _grads(grouped), atol=1e-6, rtol=1e-4)
    gram = _worker().compute_gradients(8, stats_groups=4, gram=True).statistics
    assert gram.sample_variance == pytest.approx(result.statistics.sample_variance, rel=1e-4)
    assert gram.ip_variance is not None and gram.orth_variance is not None


def test_statistics_need_two_samples():
    result = _worker().compute_gradients(1, stats_groups=4)
    assert result.samples == 2 and result.statistics.samples == 2


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_step(monkeypatch):
    reference = _worker(b_max=16)
    reference.compute_gradients(16)
    worker = _worker(b_max=16)
    model_forward = type(worker.model).forward
    calls = []

    def forward(self, *args, input_ids=None, **kwargs):
        calls.append(input_ids.size(0))
        if input_ids.size(0) > 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
        return model_forward(self, *args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(worker.model), "forward", forward)
    stream_before = copy.deepcopy(worker.stream.state_dict())
    result = worker.compute_gradients(16)
    assert result.b_max == 4 and result.samples == 16
    assert calls == [16, 8, 4, 4, 4, 4]
    assert torch.allclose(_grads(reference), _grads(worker), atol=1e-6, rtol=1e-4)
    fresh = _worker()
    fresh.stream.load_state_dict(stream_before)
    fresh.stream.next_batch(16)
    assert torch.equal(fresh.stream.generator.get_state(), worker.stream.generator.get_state())  # data read once


def test_an_empty_micro_batch_runs_a_weightless_stand_in():
    """A sharded worker's rank with fewer samples than its peers still runs each micro-batch (FSDP's collectives
    pair up): a micro-batch of size 0 adds nothing to the gradient or the loss."""
    plain, padded = _worker(), _worker()
    data = plain.stream.next_batch(3)

    def losses(slot):
        return lambda offset, size: slot.worker.step_loss(slot.model, *(t[offset : offset + size] for t in data))

    expected = backward_in_micro_batches(losses(plain), 0, 3, 3, 64)
    got = backward_in_micro_batches(losses(padded), 0, 3, 3, 64, sizes=[2, 1, 0])
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert torch.allclose(_grads(plain), _grads(padded), atol=1e-7, rtol=1e-5)
    nothing = _worker()
    assert float(backward_in_micro_batches(losses(nothing), 0, 0, 3, 64, sizes=[0])) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in nothing.params)
