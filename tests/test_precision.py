import math

import pytest
import torch

from adloco import build_config, stacked, train
from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.errors import ConfigError
from adloco.model import build_model, preset_config
from adloco.precision import adamw_kernel, autocast_for, configure_matmuls
from adloco.worker import Worker
from tests.conftest import final_params


def test_fp32_leaves_matmuls_alone_and_bf16_lowers_them():
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with autocast_for("fp32", x.device):
        assert layer(x).dtype == torch.float32
    with autocast_for("bf16", x.device):
        assert layer(x).dtype == torch.bfloat16


STACKED: set[torch.dtype] = set()


def _train_recording_linear_dtypes(overrides: list[str], monkeypatch) -> tuple[object, set[torch.dtype]]:
    """A run, and the dtypes its training steps' linear layers computed in: the modules of workers that run one
    by one, and the batched matmuls of a stacked worker group (also in ``STACKED``)."""
    seen: set[torch.dtype] = set()
    STACKED.clear()

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled():  # training steps, not evaluation
            seen.add(output.dtype)

    linear = stacked._linear

    def record_stacked(hidden, weight):
        output = linear(hidden, weight)
        seen.add(output.dtype)
        STACKED.add(output.dtype)
        return output

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(stacked, "_linear", record_stacked)
            return train(build_config(overrides=overrides)), seen
    finally:
        handle.remove()


@pytest.mark.parametrize("batched", ["true", "false"])
def test_bf16_trains_under_autocast_with_float32_weights(batched, fast_overrides, monkeypatch):
    common = [*fast_overrides, "total_tokens=2048", f"batched_workers={batched}"]
    fp32, fp32_dtypes = _train_recording_linear_dtypes(common, monkeypatch)
    bf16, bf16_dtypes = _train_recording_linear_dtypes([*common, "precision=bf16"], monkeypatch)
    assert ({torch.bfloat16} if batched == "true" else set()) == STACKED  # the stacked path itself ran in bf16
    assert fp32_dtypes == {torch.float32} and bf16_dtypes == {torch.bfloat16}
    params = final_params(bf16.run_dir)
    assert all(t.dtype == torch.float32 for t in params.values())  # master weights (and what was exchanged)
    assert math.isfinite(bf16.val_loss) and abs(bf16.val_loss / fp32.val_loss - 1) < 0.05


def test_an_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision"):
        build_config(overrides=["precision=fp16"])


def test_cuda_speed_switches_leave_the_cpu_path_as_it_was():
    """TF32 and fused AdamW are for CUDA; on CPU the matmul flags stay and AdamW stays the single-tensor loop
    that a worker group's stacked update repeats."""
    before = torch.backends.cuda.matmul.allow_tf32
    configure_matmuls(torch.device("cpu"), tf32=not before)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert adamw_kernel(torch.device("cpu")) == {"foreach": False}
    assert adamw_kernel(torch.device("cuda", 0)) == {"fused": True}
    assert build_config().tf32 and not build_config(overrides=["tf32=false"]).tf32


def test_a_resumed_optimizer_runs_the_kernel_of_the_device_it_resumes_on():
    worker = Worker(0, build_model(preset_config("tiny", 256, context=16), 0), InnerConfig(), _stream())
    state = worker.state_dict()
    for group in state["optimizer"]["param_groups"]:  # as a checkpoint written on CUDA says
        group["fused"], group["foreach"] = True, None
    worker.load_state_dict(state)
    assert {(g["fused"], g["foreach"]) for g in worker.optimizer.param_groups} == {(None, False)}


def _stream():
    return TokenStream(torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0)), 16, 0)
