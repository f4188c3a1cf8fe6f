import pytest
import torch

from adloco.models.build import build_model, preset_config
from adloco.workers.probe import ProcessMemoryMeter, probe_b_max, training_step_at


class LinearMemory:
    """A device whose peak grows by ``per_sample`` bytes per sample over a fixed base."""

    def __init__(self, base: int, per_sample: int) -> None:
        self.base, self.per_sample, self.batch, self.calls = base, per_sample, 0, []

    def step(self, batch: int) -> None:
        self.batch = batch
        self.calls.append(batch)

    def reset(self) -> None:
        self.batch = 0

    def peak_bytes(self) -> int:
        return self.base + self.per_sample * self.batch


@pytest.mark.parametrize(("budget", "expected"), [(1000 + 10 * 37, 37), (1000 + 10 * 64, 64), (1005, 0), (10**9, 64)])
def test_probe_finds_the_largest_fitting_batch(budget, expected):
    memory = LinearMemory(base=1000, per_sample=10)
    assert probe_b_max(memory.step, memory, budget, upper=64) == expected
    assert len(memory.calls) <= 14  # a search, not a scan


def test_probe_treats_out_of_memory_as_not_fitting():
    memory = LinearMemory(base=0, per_sample=1)

    def step(batch: int) -> None:
        if batch > 20:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        memory.step(batch)

    assert probe_b_max(step, memory, budget_bytes=10**9, upper=128) == 20


def test_probe_does_not_swallow_other_errors():
    memory = LinearMemory(0, 1)

    def step(batch: int) -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_b_max(step, memory, 100, upper=8)


@pytest.mark.training
def test_real_step_on_process_memory_grows_with_batch():
    """The real meter sees a bigger peak for a bigger batch of a real model's step."""
    model = build_model(preset_config("tiny", 256), 0)
    step = training_step_at(model, context=64, vocab_size=256)
    meter = ProcessMemoryMeter()
    peaks = {}
    for batch in (2, 128):
        meter.reset()
        step(batch)
        peaks[batch] = meter.peak_bytes()
    assert peaks[128] > peaks[2] + 20 * 2**20
    before = [p.clone() for p in model.parameters()]
    step(4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # scratch copy only


@pytest.mark.training
def test_cpu_budget_probe_through_the_config(tmp_path):
    from adloco.cluster.cluster import resolve_b_max
    from adloco.config import ConfigError, build_config

    model = build_model(preset_config("tiny", 256), 0)
    assert resolve_b_max(build_config(overrides=["batch.memory.b_max=7"]).batch, model, 64, 256) == 7
    assert resolve_b_max(build_config(overrides=["batch.b_cap=12"]).batch, model, 64, 256) == 12  # no budget: b_cap
    generous = resolve_b_max(
        build_config(overrides=["batch.memory.budget_mb=100000", "batch.b_cap=16"]).batch, model, 64, 256
    )
    assert generous == 16
    with pytest.raises(ConfigError, match="not even one sample"):
        resolve_b_max(build_config(overrides=["batch.memory.budget_mb=1"]).batch, model, 64, 256)


def test_a_gpu_budget_is_split_among_the_workers_that_train_on_it():
    from adloco.cluster.cluster import cuda_budget

    capacity = 80 * 2**30
    assert cuda_budget(0.9, capacity, 1) == int(0.9 * capacity)
    assert cuda_budget(0.9, capacity, 4) == int(0.9 * capacity / 4)  # 4 slots of one rank on its one GPU
    assert cuda_budget(0.5, capacity, 0) == cuda_budget(0.5, capacity, 1)
