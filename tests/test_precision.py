import math

import pytest
import torch

from adloco import build_config, train
from adloco.errors import ConfigError
from adloco.precision import autocast_for
from tests.conftest import final_params


def test_fp32_leaves_matmuls_alone_and_bf16_lowers_them():
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with autocast_for("fp32", x.device):
        assert layer(x).dtype == torch.float32
    with autocast_for("bf16", x.device):
        assert layer(x).dtype == torch.bfloat16


def _train_recording_linear_dtypes(overrides: list[str]) -> tuple[object, set[torch.dtype]]:
    seen: set[torch.dtype] = set()

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled():  # training steps, not evaluation
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        return train(build_config(overrides=overrides)), seen
    finally:
        handle.remove()


def test_bf16_trains_under_autocast_with_float32_weights(fast_overrides):
    fp32, fp32_dtypes = _train_recording_linear_dtypes([*fast_overrides, "total_tokens=2048"])
    bf16, bf16_dtypes = _train_recording_linear_dtypes([*fast_overrides, "total_tokens=2048", "precision=bf16"])
    assert fp32_dtypes == {torch.float32} and bf16_dtypes == {torch.bfloat16}
    params = final_params(bf16.run_dir)
    assert all(t.dtype == torch.float32 for t in params.values())  # master weights (and what was exchanged)
    assert math.isfinite(bf16.val_loss) and abs(bf16.val_loss / fp32.val_loss - 1) < 0.05


def test_an_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision"):
        build_config(overrides=["precision=fp16"])
