"""compile=true: compiled training steps, and a clear stop where compilation cannot run."""

import json
import math

import pytest
import torch

from adloco import build_config, train
from adloco.cli import main
from adloco.models import compilation


def test_a_machine_that_cannot_compile_is_told_at_start_with_exit_2(monkeypatch, capsys, fast_overrides):
    def no_toolchain(function):
        def fail(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

        return fail

    monkeypatch.setattr(compilation.torch, "compile", no_toolchain)
    assert main(["train", *fast_overrides, "compile=true"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "adloco: error: compile: torch.compile cannot run on cpu here "
        "(InvalidCxxCompiler: No working C++ compiler found)"
    )


@pytest.mark.process
@pytest.mark.parametrize("batched", ["true", "false"])
def test_compiled_steps_train_as_the_eager_ones_do(batched, fast_overrides, monkeypatch, tmp_path):
    """The stacked group's model (batched) or each worker's loss (one by one) runs compiled; the run ends
    where the eager run ends, within the rounding that fused kernels bring. One layer: compiling is slow."""
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = tmp_path / "one-layer.json"
    config.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 16, **shape}))
    common = [*fast_overrides, f"model.path={config}", f"batched_workers={batched}", "total_tokens=512"]
    calls = []
    original = torch.compile

    def counting(function, *args, **kwargs):
        calls.append(getattr(function, "__name__", type(function).__name__))
        return original(function, *args, **kwargs)

    eager = train(build_config(overrides=common))
    monkeypatch.setattr(torch, "compile", counting)
    fast = train(build_config(overrides=[*common, "compile=true"]))
    assert ("losses" if batched == "true" else "next_token_loss") in calls
    assert math.isfinite(fast.val_loss) and fast.val_loss == pytest.approx(eager.val_loss, rel=1e-3)
