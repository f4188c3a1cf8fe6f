"""Streaming DiLoCo and quantized exchange in the engine (test vectors 7 and 8 of docs/design.md, end to end)."""

import pytest
import torch

from adloco.algorithms.sparse import TopKCodec
from adloco.config import ConfigError, build_config
from adloco.metrics.writer import read_metrics
from adloco.models.build import build_model, preset_config
from adloco.run.training import train
from adloco.sync.streaming import parameter_fragments
from tests.conftest import cut_back, final_params, same_params

STREAM = ["method=streaming", "sync_every=4", "streaming.fragments=2", "streaming.overlap=1", "total_tokens=1024"]


def _rounds(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


@pytest.mark.training
def test_one_fragment_no_overlap_no_mixing_is_diloco(fast_overrides):
    diloco = train(build_config(overrides=[*fast_overrides, "method=diloco"]))
    streaming = train(
        build_config(
            overrides=[
                *fast_overrides,
                "method=streaming",
                "streaming.fragments=1",
                "streaming.overlap=0",
                "streaming.alpha=0",
            ]
        )
    )
    assert same_params(final_params(diloco.run_dir), final_params(streaming.run_dir))


@pytest.mark.training
def test_fp32_codec_is_bit_equal_to_no_codec(fast_overrides):
    plain = train(build_config(overrides=[*fast_overrides, "method=diloco"]))
    coded = train(build_config(overrides=[*fast_overrides, "method=diloco", "codec.name=fp32"]))
    assert same_params(final_params(plain.run_dir), final_params(coded.run_dir))


def test_a_fragment_sync_changes_only_that_fragment(fast_overrides):
    """Run streaming to just after fragment 1's first sync (step 2 of H = 4, P = 2): fragment 0 of θ is untouched."""
    config = build_config(overrides=[*fast_overrides, *STREAM, "total_tokens=128", "streaming.overlap=0"])
    result = train(config)
    init = build_model(preset_config("tiny", 256, 16), config.seed)
    names = [n for n, _ in init.named_parameters()]
    final = final_params(result.run_dir)
    blocks = {n: (int(n.split(".")[2]) if ".layers." in n else None) for n in names}
    init_params = dict(init.named_parameters())
    for name in names:
        unchanged = torch.equal(final[name], init_params[name].detach())
        if blocks[name] is not None and blocks[name] % 2 == 1:
            assert not unchanged, name  # fragment 1 (odd blocks) synced at step 2
        else:
            assert unchanged, name  # fragment 0 (even blocks, embeddings, head) has not synced yet


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0"])
def test_streaming_with_each_codec(codec, fast_overrides):
    result = train(build_config(overrides=[*fast_overrides, *STREAM, f"codec.name={codec}"]))
    assert result.val_loss < 5.3
    rounds = _rounds(result.run_dir)
    params = sum(t.numel() for t in final_params(result.run_dir).values())
    bits = {"bf16": 16, "fp16": 16, "int8": 8, "fp8-e4m3": 8, "fp4-e2m1": 4, "fp4-e3m0": 4}[codec]
    full_fp32 = 2 * 4 * params  # both workers, whole model, float32
    sent = rounds[1]["bytes"]  # a full round: each fragment synced once
    assert sent < full_fp32 * (bits / 32) * 1.1 + 2000 and sent > full_fp32 * (bits / 32) * 0.95


@pytest.mark.training
def test_peak_bytes_per_sync_is_one_fragment(fast_overrides):
    streaming = train(
        build_config(
            overrides=[*fast_overrides, *STREAM, "streaming.shared=own", "streaming.fragments=3", "sync_every=6"]
        )
    )
    diloco = train(build_config(overrides=[*fast_overrides, "method=diloco"]))
    peak, full = _rounds(streaming.run_dir)[-1]["peak_sync_bytes"], _rounds(diloco.run_dir)[-1]["peak_sync_bytes"]
    params = sum(t.numel() for t in final_params(diloco.run_dir).values())
    assert full == 2 * 4 * params
    # own: embeddings+head form fragment 0; the 4 blocks split 2/2 over fragments 1 and 2
    assert peak < 0.5 * full


@pytest.mark.training
@pytest.mark.parametrize("checkpoint_format", ["file", "sharded"])
def test_resume_with_an_exchange_in_flight_is_bit_identical(checkpoint_format, fast_overrides, tmp_path):
    """Worker parameters, error-feedback residuals and an exchange in flight all go through the checkpoint."""
    config = build_config(
        overrides=[
            *fast_overrides,
            *STREAM,
            "codec.name=int8",
            "codec.error_feedback=true",
            "checkpoint.every=1",
            "checkpoint.keep=100",
            f"checkpoint.format={checkpoint_format}",
        ]
    )
    full = train(config)
    partial = cut_back(full.run_dir, tmp_path / "partial", keep=1)
    train(config, resume=partial)
    assert same_params(final_params(full.run_dir), final_params(partial))


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["method=streaming", "sync_every=10", "streaming.fragments=3"], "multiple"),
        (["method=streaming", "sync_every=10", "streaming.fragments=2", "streaming.overlap=5"], "overlap"),
        (["method=diloco", "streaming.fragments=2"], "only method=streaming"),
        (["method=ddp", "codec.name=int8"], "codec.name"),
        (["codec.name=fp5"], "codec.name"),
    ],
)
def test_streaming_config_errors(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_config(overrides=overrides)


def test_topk_sends_exactly_its_payload_with_error_feedback_on_by_default(fast_overrides):
    """Streaming fragments each encoded on their own: a full round sends both workers' sparse payload of every
    fragment (indices, 2-bit values, chunk scales) and their round reports, and still trains."""
    config = build_config(overrides=[*fast_overrides, *STREAM, "codec.name=topk", "codec.density=0.03"])
    assert config.codec.error_feedback is True
    result = train(config)
    assert result.val_loss < 5.3
    params = final_params(result.run_dir)
    sizes = [t.numel() for t in params.values()]
    fragments = parameter_fragments(config.streaming, list(params))
    codec = TopKCodec(0.03, 2, 4096)
    payload = 2 * sum(codec.encoded_nbytes(sum(sizes[i] for i in fragment)) for fragment in fragments)
    sent = _rounds(result.run_dir)[1]["bytes"]
    assert payload <= sent < payload + 2000  # the reports ride along: a few hundred bytes
    assert sent < 2 * 4 * sum(sizes) / 25
