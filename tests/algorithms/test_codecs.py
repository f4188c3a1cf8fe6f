"""test vector 8 of docs/design.md: codecs for exchanged pseudo-gradients (exactness, error bounds, payload sizes)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adloco.algorithms.codecs import (
    CODEC_NAMES,
    DEFAULT_BLOCK_SIZE,
    Encoded,
    ErrorFeedback,
    decode_and_average,
    get_codec,
)

BLOCKED = ("int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0")
TOP = {"int8": 127.0, "fp8-e4m3": 448.0, "fp4-e2m1": 6.0, "fp4-e3m0": 1.0}


def _sample(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # several orders of magnitude, as pseudo-gradients have
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)


def _roundtrip(codec, x):
    return codec.decode(codec.encode(x), x.shape)


def _element_scales(codec, encoded):
    """The scale 2^e of each element's block, read from the payload."""
    exponents = encoded.scales.view(torch.int8).double()
    return torch.exp2(exponents).repeat_interleave(codec.block_size)[: encoded.numel]


def _block_absmax(x, block):
    pad = (-len(x)) % block
    blocks = torch.nn.functional.pad(x.abs().double(), (0, pad)).view(-1, block)
    return blocks.amax(1).repeat_interleave(block)[: len(x)]


def _check_scales_are_tight(name, codec, x, encoded):
    """The block absmax fits the format (≤ top·s) and wastes less than one bit of range (> top·s/2)."""
    s, absmax = _element_scales(codec, encoded), _block_absmax(x, codec.block_size)
    nonzero = absmax > 0
    assert torch.all(absmax <= TOP[name] * s)
    assert torch.all(absmax[nonzero] > TOP[name] * s[nonzero] / 2)
    return s


def test_fp32_is_bit_exact_and_does_not_alias_the_input():
    x = _sample()
    codec = get_codec("fp32")
    encoded = codec.encode(x)
    expected = x.clone()
    x.add_(1.0)  # the caller reuses its buffer: the payload must not change with it
    assert torch.equal(codec.decode(encoded), expected)
    assert torch.equal(_roundtrip(codec, expected), expected)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zero_sign_idempotence_and_payload_size(name):
    codec = get_codec(name, block_size=32)
    x = _sample(1001)  # a partial last block
    x[5] = 0.0
    encoded = codec.encode(x)
    y = codec.decode(encoded, x.shape)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert y[5] == 0
    assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))
    assert torch.equal(_roundtrip(codec, y), y)  # q(q(x)) = q(x), exactly
    assert encoded.codes.dtype == torch.uint8 and encoded.codes.dim() == 1
    assert encoded.nbytes == codec.encoded_nbytes(x.numel())
    scales = 0 if encoded.scales is None else encoded.scales.numel()
    assert scales == (math.ceil(1001 / 32) if name in BLOCKED else 0)
    assert encoded.nbytes == encoded.codes.numel() + scales
    assert torch.equal(_roundtrip(codec, torch.zeros(70)), torch.zeros(70))


def test_bytes_per_element():
    n = 32 * 100
    sizes = {name: get_codec(name, 32).encoded_nbytes(n) / n for name in CODEC_NAMES}
    assert sizes["fp32"] == 4 and sizes["bf16"] == 2 and sizes["fp16"] == 2
    assert sizes["int8"] == 1 + 1 / 32 and sizes["fp8-e4m3"] == 1 + 1 / 32
    assert sizes["fp4-e2m1"] == 0.5 + 1 / 32 and sizes["fp4-e3m0"] == 0.5 + 1 / 32
    # odd counts: fp4 rounds the last half byte up, the last block is partial
    assert get_codec("fp4-e2m1", 128).encoded_nbytes(1001) == 501 + 8
    assert get_codec("int8", 7).encoded_nbytes(15) == 15 + 3
    assert DEFAULT_BLOCK_SIZE == 32


def test_int8_error_is_at_most_half_a_step():
    codec, x = get_codec("int8", 32), _sample()
    encoded = codec.encode(x)
    s = _check_scales_are_tight("int8", codec, x, encoded)
    err = (codec.decode(encoded).double() - x.double()).abs()
    assert torch.all(err <= s / 2)
    # with a power-of-two scale the step is below 2·absmax/127, so the error stays below absmax/127
    assert torch.all(err < _block_absmax(x, 32) / 127)


def test_fp8_relative_error():
    codec, x = get_codec("fp8-e4m3", 32), _sample()
    encoded = codec.encode(x)
    s = _check_scales_are_tight("fp8-e4m3", codec, x, encoded)
    err = (codec.decode(encoded).double() - x.double()).abs()
    # 3 mantissa bits: half an ulp is ≤ 2^-4 of the value for normal numbers; below 2^-6 (scaled) the
    # spacing is the subnormal step 2^-9, so the error is at most half of that.
    assert torch.all(err <= torch.maximum(x.abs().double() * 2**-4, s * 2**-10))


def test_fp4_e2m1_error_follows_the_grid_spacing():
    codec, x = get_codec("fp4-e2m1", 32), _sample()
    encoded = codec.encode(x)
    s = _check_scales_are_tight("fp4-e2m1", codec, x, encoded)
    scaled = x.abs().double() / s
    # spacing of the 0..6 grid: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; the error is at most half of it
    half_gap = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0)) * s
    assert torch.all((codec.decode(encoded).double() - x.double()).abs() <= half_gap)


def test_fp4_e3m0_values_are_powers_of_two_times_the_scale():
    codec, x = get_codec("fp4-e3m0", 32), _sample()
    encoded = codec.encode(x)
    s = _check_scales_are_tight("fp4-e3m0", codec, x, encoded)
    y = codec.decode(encoded).double()
    exponents = torch.log2((y.abs() / s)[y != 0])
    assert torch.equal(exponents, torch.round(exponents)) and exponents.min() >= -6 and exponents.max() <= 0
    # nearest power of two: relative error at most 1/3 (at 0.75·2^k), or 2^-7·s below 2^-6·s
    err = (y - x.double()).abs()
    assert torch.all(err <= torch.maximum(x.abs().double() / 3, s * 2**-7))


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("k", [-110, -40, -3, 0, 5, 60, 110])
def test_grid_values_at_full_scale_round_trip_exactly(name, k):
    """A block whose absmax is exactly top·2^k must get scale 2^k (no bit of range lost) and be exact."""
    codec = get_codec(name, 8)
    grid = {"int8": [127, -64, 3, 0, -1, 100, 7, 126], "fp8-e4m3": [448, -0.5, 3.5, 0, 2**-9, -240, 1, 6]}
    grid["fp4-e2m1"] = [6, -0.5, 1.5, 0, 3, -4, 2, 1]
    grid["fp4-e3m0"] = [1, -0.5, 2**-6, 0, 0.25, -1, 2**-3, 2**-5]
    x = (torch.tensor(grid[name], dtype=torch.float64) * 2.0**k).float()
    encoded = codec.encode(x)
    assert encoded.scales.view(torch.int8).item() == k
    assert torch.equal(codec.decode(encoded), x)


def test_exponent_is_clamped_to_the_int8_range():
    """Blocks below top·2^-127 (~1e-36 for int8) keep scale 2^-127: coarser, but no overflow or NaN."""
    codec = get_codec("int8", 4)
    x = torch.tensor([127 * 2.0**-130, 2.0**-130, 0, 0])
    encoded = codec.encode(x)
    assert encoded.scales.view(torch.int8).item() == -127
    assert torch.all((codec.decode(encoded).double() - x.double()).abs() <= 2.0**-128)


@pytest.mark.parametrize("name", BLOCKED)
def test_zero_block_between_others_decodes_to_zero(name):
    codec = get_codec(name, 4)
    x = torch.tensor([1.0, -2.0, 3.0, 0.5, 0, 0, 0, 0, 1e-3, 2e-3, -4e-3, 0])
    y = _roundtrip(codec, x)
    assert torch.isfinite(y).all() and torch.equal(y[4:8], torch.zeros(4))
    assert encoded_exponent(codec, x)[1] == -127


def encoded_exponent(codec, x):
    return codec.encode(x).scales.view(torch.int8).tolist()


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_extreme_magnitudes_stay_finite(name):
    codec = get_codec(name, 4)
    biggest = torch.finfo(torch.float32).max
    x = torch.tensor([2.0**127, -1.0e38, 1.0, 1e-45, -1.6e38, 0.0, 2.0**-140, 1.0e-40])
    if name in BLOCKED:
        # just above 2^127 the nearest grid value times the scale would overflow: refused
        with pytest.raises(ValueError, match="beyond"):
            codec.encode(torch.tensor([biggest, 1.0]))
    else:
        x[0] = biggest
    y = _roundtrip(codec, x)
    assert torch.isfinite(y).all()
    assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))
    assert torch.equal(_roundtrip(codec, y), y)
    if name in ("fp16", "bf16"):
        assert y[0] == torch.finfo(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[name])).max
    elif name != "fp4-e3m0":
        assert torch.allclose(y[:2], x[:2], rtol=0.25)  # scaled, not saturated


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad):
    with pytest.raises(ValueError, match="int8: cannot encode a tensor with NaN or infinite"):
        get_codec("int8").encode(torch.tensor([1.0, bad]))


def test_unknown_codec_and_bad_block_size():
    with pytest.raises(ValueError, match="'fp3'.*fp32, bf16, fp16, int8, fp8-e4m3, fp4-e2m1, fp4-e3m0"):
        get_codec("fp3")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        get_codec("int8", 0)


def test_decode_refuses_a_payload_of_the_wrong_size():
    codec = get_codec("fp4-e2m1", 32)
    encoded = codec.encode(_sample(100))
    with pytest.raises(ValueError, match="100 elements need 50 uint8 codes, got 49"):
        codec.decode(Encoded(encoded.codes[:49], encoded.scales, 100))
    with pytest.raises(ValueError, match="expected 4 block scales, got 3"):
        codec.decode(Encoded(encoded.codes, encoded.scales[:3], 100))
    with pytest.raises(ValueError, match="expected 0 block scales"):
        get_codec("bf16").decode(Encoded(torch.zeros(200, dtype=torch.uint8), encoded.scales, 100))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_input_dtypes_are_encoded_in_float32(dtype):
    x = _sample(64).to(dtype).view(8, 8)
    for name in CODEC_NAMES:
        codec = get_codec(name)
        y = codec.decode(codec.encode(x), x.shape)
        assert y.dtype == torch.float32 and y.shape == (8, 8)
        assert torch.equal(y, codec.decode(codec.encode(x.float()), (8, 8)))


@settings(max_examples=80, deadline=None, database=None)
@given(
    name=st.sampled_from(CODEC_NAMES),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    block=st.sampled_from([1, 7, 32, 64]),
    log_scale=st.floats(-30, 30),
    zero_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_codec_properties(name, shape, block, log_scale, zero_fraction, seed):
    codec = get_codec(name, block)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * math.exp(log_scale)
    x[torch.rand(shape, generator=g) < zero_fraction] = 0.0
    encoded = codec.encode(x)
    y = codec.decode(encoded, x.shape)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert encoded.nbytes == codec.encoded_nbytes(x.numel())
    assert torch.equal(_roundtrip(codec, y), y)
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))
    assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))
    if name in BLOCKED:
        flat, out = x.reshape(-1), y.reshape(-1)
        s = _check_scales_are_tight(name, codec, flat, encoded)
        assert torch.all(out.abs().double() <= TOP[name] * s)
        err = (out.double() - flat.double()).abs()
        bound = {
            "int8": s / 2,
            "fp8-e4m3": torch.maximum(flat.abs().double() * 2**-4, s * 2**-10),
            "fp4-e2m1": s,  # the widest half gap
            "fp4-e3m0": torch.maximum(flat.abs().double() / 3, s * 2**-7),
        }[name]
        assert torch.all(err <= bound)
    elif name != "fp32":
        rel = 2**-8 if name == "bf16" else 2**-11  # unit roundoff: 8 and 11 significand bits
        # fp16 flushes below its subnormal range; allow its smallest half step there
        floor = 0.0 if name == "bf16" else 2.0**-25
        limit = 65504.0 if name == "fp16" else torch.finfo(torch.bfloat16).max
        inside = x.abs() <= limit
        assert torch.all((y.double() - x.double()).abs()[inside] <= x.abs().double()[inside] * rel + floor)
        assert torch.equal(y[~inside], torch.sign(x[~inside]) * limit)  # saturated


def test_decode_and_average_reduces_in_float32_in_list_order():
    xs = [_sample(100, seed) for seed in range(3)]
    codec = get_codec("fp32")
    average = decode_and_average([codec.encode(x) for x in xs], codec, (10, 10))
    expected = ((xs[0] + xs[1]) + xs[2]) / 3
    assert average.shape == (10, 10) and torch.equal(average.reshape(-1), expected)
    codec = get_codec("int8", 16)
    encoded = [codec.encode(x) for x in xs]
    decoded = [codec.decode(e) for e in encoded]
    assert torch.equal(decode_and_average(encoded, codec), ((decoded[0] + decoded[1]) + decoded[2]) / 3)
    with pytest.raises(ValueError, match="at least one"):
        decode_and_average([], codec)


def test_error_feedback_carries_the_residual():
    codec = get_codec("fp4-e2m1", 32)
    feedback = ErrorFeedback()
    x = _sample(64)
    assert feedback.compensate("f", x) is x  # nothing recorded yet
    sent = []
    for _ in range(50):
        compensated = feedback.compensate("f", x)
        decoded = codec.decode(codec.encode(compensated))
        feedback.record("f", compensated, decoded)
        sent.append(decoded)
    # sent so far = 50·x − residual, so the running mean of what was sent converges to x
    assert torch.allclose(torch.stack(sent).sum(0) + feedback.residuals["f"], 50 * x, rtol=1e-5, atol=1e-4)
    one_shot = (codec.decode(codec.encode(x)) - x).abs().mean()
    averaged = (torch.stack(sent).mean(0) - x).abs().mean()
    assert averaged < one_shot / 5
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.compensate("f", x), feedback.compensate("f", x))
    assert torch.equal(restored.compensate("other", x), x)  # keys are independent
    with pytest.raises(ValueError, match="residual shape"):
        restored.compensate("f", x[:10])


@pytest.mark.parametrize(
    ("name", "values", "expected"),
    [
        ("fp4-e2m1", [6.0, 2.5, 0.25, -5.0, 1.75, -0.2], [6.0, 3.0, 0.5, -6.0, 2.0, 0.0]),
        ("fp4-e3m0", [1.0, 0.75, -0.375, 2.0**-7, 0.3, -(2.0**-8)], [1.0, 1.0, -0.5, 2.0**-6, 0.25, 0.0]),
    ],
)
def test_fp4_rounds_to_nearest_with_ties_away_from_zero(name, values, expected):
    codec = get_codec(name, 8)
    assert _roundtrip(codec, torch.tensor(values)).tolist() == expected
