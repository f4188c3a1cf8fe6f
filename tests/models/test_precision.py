import math

import pytest
import torch

from adloco import build_config, train
from adloco.config import InnerConfig
from adloco.data import TokenStream
from adloco.errors import ConfigError
from adloco.models import stacked
from adloco.models.build import build_model, next_token_loss, preset_config
from adloco.models.precision import AUTOCAST_DTYPES, LossScale, adamw_kernel, autocast_for, configure_matmuls
from adloco.workers.worker import Worker
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


@pytest.mark.training
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("batched", ["true", "false"])
def test_half_precisions_train_under_autocast_with_float32_weights(precision, batched, fast_overrides, monkeypatch):
    common = [*fast_overrides, "total_tokens=2048", f"batched_workers={batched}"]
    fp32, fp32_dtypes = _train_recording_linear_dtypes(common, monkeypatch)
    half, half_dtypes = _train_recording_linear_dtypes([*common, f"precision={precision}"], monkeypatch)
    dtype = AUTOCAST_DTYPES[precision]
    assert ({dtype} if batched == "true" else set()) == STACKED  # the stacked path itself ran in half precision
    assert fp32_dtypes == {torch.float32} and half_dtypes == {dtype}
    params = final_params(half.run_dir)
    assert all(t.dtype == torch.float32 for t in params.values())  # master weights (and what was exchanged)
    assert math.isfinite(half.val_loss) and abs(half.val_loss / fp32.val_loss - 1) < 0.05


def _small_loss(model, inputs, targets):
    """A loss whose gradients, like a large model's, fall below float16's smallest numbers unless scaled."""
    return next_token_loss(model, inputs, targets) * 1e-4


def _flat_grad(worker: Worker) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in worker.params])


def _fp16_worker(loss_fn=next_token_loss) -> Worker:
    return Worker(0, build_model(preset_config("tiny", 256, context=16), 0), InnerConfig(), _stream(), loss_fn, "fp16")


def test_the_fp16_loss_scale_keeps_small_gradients_from_flushing_to_zero():
    reference = Worker(0, build_model(preset_config("tiny", 256, context=16), 0), InnerConfig(), _stream(), _small_loss)
    scaled, unscaled = _fp16_worker(_small_loss), _fp16_worker(_small_loss)
    unscaled.loss_scale = LossScale()  # the constant 1 of fp32 and bf16
    for worker in (reference, scaled, unscaled):
        worker.compute_gradients(4, 4)
    exact = _flat_grad(reference)

    def error(worker: Worker) -> float:
        return float((_flat_grad(worker) - exact).norm() / exact.norm())

    assert scaled.loss_scale.scale == LossScale.INITIAL and scaled.loss_scale.good_steps == 1
    assert error(scaled) < 0.01 and error(unscaled) > 0.5


@pytest.mark.training
def test_an_fp16_step_that_overflows_is_computed_again_with_half_the_scale():
    worker, retrier = _fp16_worker(), _fp16_worker()
    worker.loss_scale.scale = 2.0**40
    result = worker.compute_gradients(4, 2)
    assert result.finite and LossScale.FLOOR <= worker.loss_scale.scale < 2.0**40
    retrier.loss_scale.scale = worker.loss_scale.scale  # the scale the retries settled on, on the same samples
    assert retrier.compute_gradients(4, 2).loss == result.loss
    assert torch.equal(_flat_grad(retrier), _flat_grad(worker))
    # the retries drew no further samples
    assert torch.equal(worker.stream.state_dict()["generator"], retrier.stream.state_dict()["generator"])


def test_a_non_finite_fp16_loss_is_not_blamed_on_the_scale():
    worker = _fp16_worker()
    with torch.no_grad():
        worker.params[0].fill_(float("nan"))
    assert not worker.compute_gradients(4, 4).finite
    assert worker.loss_scale.scale == LossScale.INITIAL and worker.loss_scale.good_steps == 0


def test_the_loss_scale_grows_after_a_run_of_good_steps_and_is_saved():
    scale = LossScale.for_precision("fp16")
    for _ in range(LossScale.GROWTH_INTERVAL - 1):
        scale.settle(True, scale.scale)
    assert scale.scale == LossScale.INITIAL
    scale.settle(True, scale.scale)
    assert scale.scale == 2 * LossScale.INITIAL and scale.good_steps == 0
    before = scale.scale
    assert scale.back_off() and scale.scale == before / 2
    scale.settle(False, before)  # a step no smaller scale cured goes back to where it began
    assert scale.scale == before
    scale.scale = LossScale.FLOOR
    assert not scale.back_off()
    assert not LossScale.for_precision("bf16").back_off() and LossScale.for_precision("bf16").scale == 1

    worker, resumed = _fp16_worker(), _fp16_worker()
    worker.loss_scale.scale, worker.loss_scale.good_steps = 2.0**9, 17
    resumed.load_state_dict(worker.state_dict())
    assert resumed.loss_scale == worker.loss_scale


def test_an_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision"):
        build_config(overrides=["precision=fp8"])


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


def test_a_loss_scale_out_of_range_in_a_checkpoint_is_refused():
    for scale in (float("nan"), 0.5, 2.0**30):
        with pytest.raises(ValueError, match="loss scale"):
            LossScale.for_precision("fp16").load_state_dict({"scale": scale, "good_steps": 0})


def test_auto_precision_is_bf16_on_a_cuda_gpu_and_fp32_elsewhere():
    from adloco.cluster.placement import resolve_device
    from adloco.config import build_config
    from adloco.models.precision import resolved_precision

    assert resolved_precision("auto", torch.device("cpu")) == "fp32"
    assert resolved_precision("fp16", torch.device("cpu")) == "fp16"  # asked for: kept
    config = build_config(overrides=["device=cpu"])
    assert config.precision == "auto"
    _, config.precision = resolve_device(config.device, config.precision, config.tf32)
    assert config.precision == "fp32"  # what config.yaml records
