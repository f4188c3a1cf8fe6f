import pytest

# A run small enough for the test suite: tiny LLaMA at context 16, two workers, a few rounds.
FAST = [
    "model.context=16",
    "workers=2",
    "batch.size=2",
    "sync_every=4",
    "total_tokens=1024",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "run.progress=false",
    "run.plots=false",
]


@pytest.fixture
def fast_overrides(tmp_path):
    return [*FAST, f"run.root={tmp_path / 'runs'}"]
