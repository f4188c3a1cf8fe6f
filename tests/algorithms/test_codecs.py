"""DESIGN §5 vector 8: codecs for exchanged pseudo-gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adloco.algorithms.codecs import CODEC_NAMES, ErrorFeedback, get_codec

BLOCKED = ("int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0")


def _sample(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # several orders of magnitude, as pseudo-gradients have
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)


def _roundtrip(codec, x):
    return codec.decode(codec.encode(x), x.shape)


def test_fp32_is_bit_exact():
    x = _sample()
    codec = get_codec("fp32")
    assert torch.equal(_roundtrip(codec, x), x)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zero_sign_idempotence_and_payload_size(name):
    codec = get_codec(name, block_size=32)
    x = _sample(1001)  # a partial last block
    x[5] = 0.0
    encoded = codec.encode(x)
    y = codec.decode(encoded, x.shape)
    assert y[5] == 0
    assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))
    assert torch.equal(_roundtrip(codec, y), y)  # q(q(x)) = q(x), exactly
    assert encoded.codes.dtype == torch.uint8
    assert encoded.nbytes == codec.encoded_nbytes(x.numel())
    scales = 0 if encoded.scales is None else encoded.scales.numel()
    assert encoded.nbytes == encoded.codes.numel() + scales
    assert torch.equal(_roundtrip(codec, torch.zeros(70)), torch.zeros(70))


def test_bytes_per_element():
    n = 32 * 100
    sizes = {name: get_codec(name, 32).encoded_nbytes(n) / n for name in CODEC_NAMES}
    assert sizes["fp32"] == 4 and sizes["bf16"] == 2 and sizes["fp16"] == 2
    assert sizes["int8"] == 1 + 1 / 32 and sizes["fp8-e4m3"] == 1 + 1 / 32
    assert sizes["fp4-e2m1"] == 0.5 + 1 / 32 and sizes["fp4-e3m0"] == 0.5 + 1 / 32


def _block_absmax(x, block):
    pad = (-len(x)) % block
    blocks = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block)
    return blocks.amax(1).repeat_interleave(block)[: len(x)]


def _scale(absmax, top):
    return torch.exp2(torch.ceil(torch.log2(absmax / top)))


def test_int8_error_is_at_most_half_a_step():
    codec, x = get_codec("int8", 32), _sample()
    step = _scale(_block_absmax(x, 32), 127)
    assert torch.all((_roundtrip(codec, x) - x).abs() <= step / 2 + 1e-12)


def test_fp8_relative_error():
    codec, x = get_codec("fp8-e4m3", 32), _sample()
    scale = _scale(_block_absmax(x, 32), 448)
    err = (_roundtrip(codec, x) - x).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normal numbers; below 2^-6 (scaled) the
    # spacing is the subnormal step 2^-9, so the error is at most half of that.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert torch.all(err <= bound * (1 + 1e-6))


def test_fp4_e2m1_error_follows_the_grid_spacing():
    codec, x = get_codec("fp4-e2m1", 32), _sample()
    scale = _scale(_block_absmax(x, 32), 6)
    scaled = x.abs() / scale
    # spacing of 0..6 grid: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; error is at most half the spacing
    half_gap = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0)) * scale
    assert torch.all((_roundtrip(codec, x) - x).abs() <= half_gap * (1 + 1e-6))


def test_fp4_e3m0_values_are_powers_of_two_times_the_scale():
    codec, x = get_codec("fp4-e3m0", 32), _sample()
    scale = _scale(_block_absmax(x, 32), 1.0)
    y = _roundtrip(codec, x)
    ratio = (y.abs() / scale)[y != 0]
    exponents = torch.log2(ratio)
    assert torch.equal(exponents, torch.round(exponents)) and exponents.min() >= -6 and exponents.max() <= 0
    scaled = x.abs() / scale
    err = (y - x).abs() / scale
    # nearest of 2^-k neighbours: error at most half the gap to the next power (or 2^-7 near zero)
    assert torch.all(err <= torch.maximum(scaled / 3, torch.full_like(scaled, 2**-7)) + 1e-7)


def test_non_finite_input_is_refused():
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("int8").encode(torch.tensor([1.0, float("nan")]))


def test_unknown_codec_lists_the_names():
    with pytest.raises(ValueError, match="fp4-e2m1"):
        get_codec("fp3")


@settings(max_examples=60, deadline=None, database=None)
@given(
    name=st.sampled_from(BLOCKED),
    n=st.integers(1, 300),
    block=st.sampled_from([1, 7, 32, 64]),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 10_000),
)
def test_blocked_codecs_properties(name, n, block, log_scale, seed):
    codec = get_codec(name, block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * math.exp(log_scale)
    encoded = codec.encode(x)
    y = codec.decode(encoded, x.shape)
    assert torch.isfinite(y).all()
    assert encoded.nbytes == codec.encoded_nbytes(n)
    assert torch.equal(_roundtrip(codec, y), y)
    # never larger than the block's absmax rounded up to the next power of two
    assert torch.all(y.abs() <= 2 * _block_absmax(x, block) + 1e-30)


def test_error_feedback_carries_the_residual():
    codec = get_codec("fp4-e2m1", 32)
    feedback = ErrorFeedback()
    x = _sample(64)
    sent = []
    for _ in range(50):
        compensated = feedback.compensate("f", x)
        decoded = codec.decode(codec.encode(compensated))
        feedback.record("f", compensated, decoded)
        sent.append(decoded)
    # what was sent over 50 rounds averages to the true value much better than one quantized copy
    one_shot = (codec.decode(codec.encode(x)) - x).abs().mean()
    averaged = (torch.stack(sent).mean(0) - x).abs().mean()
    assert averaged < one_shot / 5
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.compensate("f", x), feedback.compensate("f", x))
