"""The top-k codec: exact payload sizes, what it keeps, how far its values are off, and error feedback."""

import math

import pytest
import torch

from adloco.algorithms.codecs import ErrorFeedback, decode_and_average
from adloco.algorithms.sparse import TopKCodec, pack_bits, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 12, 16])
def test_bits_pack_without_gaps_and_unpack_exactly(bits):
    values = torch.randint(0, 2**bits, (37,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(37 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 37), values)


def test_float32_values_keep_exactly_the_k_largest_magnitudes_of_each_chunk():
    codec = TopKCodec(density=0.25, value_bits=32, chunk_size=8)  # k = 2 per chunk
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, 0.0, 0.3, -0.1, 9.0, 0.5, -0.6])  # a last chunk of 3, padded
    decoded = codec.decode(codec.encode(x))
    expected = torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, -0.6])
    assert torch.equal(decoded, expected)


def test_two_bit_values_are_within_half_a_level_and_the_codec_is_idempotent():
    codec = TopKCodec(density=0.05, value_bits=2, chunk_size=256)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert encoded.nbytes == codec.encoded_nbytes(1000)
    # 4 chunks of k = 13: 52 indices of 8 bits, 52 values of 2 bits, 4 float32 scales
    assert codec.encoded_nbytes(1000) == 52 + 13 + 16
    kept = decoded != 0
    assert int(kept.sum()) == 52 and torch.equal(torch.sign(decoded[kept]), torch.sign(x[kept]))
    for chunk in range(4):
        part = slice(256 * chunk, 256 * (chunk + 1))
        m = float(x[part].abs().max())
        error = (decoded[part] - x[part])[kept[part]].abs()
        assert float(error.max()) <= m / 4 + 1e-6  # L = 2 levels: m/2 and m
    assert torch.equal(codec.decode(codec.encode(decoded)), decoded)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(1000))), torch.zeros(1000))


def test_one_percent_at_two_bits_sends_over_150x_fewer_bytes_than_float32():
    codec = TopKCodec(density=0.01, value_bits=2, chunk_size=4096)
    numel = 4096 * 100
    # per chunk: 41 indices of 12 bits, 41 values of 2 bits, one float32 scale
    assert codec.encoded_nbytes(numel) == math.ceil(4100 * 12 / 8) + math.ceil(4100 * 2 / 8) + 400
    assert 4 * numel / codec.encoded_nbytes(numel) > 150


def test_error_feedback_delivers_every_entry_over_the_rounds():
    """What a round leaves out is carried to the next: the running sum of what was sent is the running sum of the
    inputs less one residual, which stays bounded (each entry waits its turn, about chunk/k rounds)."""
    codec, feedback = TopKCodec(density=1 / 16, value_bits=2, chunk_size=64), ErrorFeedback()
    x = torch.rand(640, generator=torch.Generator().manual_seed(3)) + 0.5
    sent, relative = torch.zeros(640), {}
    for rounds in range(1, 401):
        compensated = feedback.compensate("0/0", x)
        decoded = codec.decode(codec.encode(compensated))
        feedback.record("0/0", compensated, decoded)
        sent += decoded
        if rounds in (100, 400):
            residual = feedback.residuals["0/0"]
            torch.testing.assert_close(sent + residual, rounds * x, rtol=1e-4, atol=1e-3)
            assert float(residual.abs().max()) < 2 * 16 * float(x.max())
            relative[rounds] = float(((sent - rounds * x).abs() / (rounds * x)).max())
    assert relative[400] < 0.1 and relative[400] < relative[100] / 2  # the shortfall does not grow with the rounds


def test_payloads_of_the_wrong_size_are_refused():
    codec = TopKCodec(density=0.1, value_bits=4, chunk_size=32)
    encoded = codec.encode(torch.randn(100))
    encoded.codes = encoded.codes[:-1]
    with pytest.raises(ValueError, match="codec topk"):
        codec.decode(encoded)
    with pytest.raises(ValueError, match="value_bits"):
        TopKCodec(value_bits=9)


def test_workers_payloads_average_in_float32():
    codec = TopKCodec(density=0.5, value_bits=32, chunk_size=4)
    a, b = torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor([0.0, 4.0, 2.0, 0.0])
    mean = decode_and_average([codec.encode(a), codec.encode(b)], codec)
    assert torch.equal(mean, torch.tensor([0.5, 2.0, 2.0, 0.0]))


def test_a_decayed_feedback_adds_back_beta_times_the_residual():
    """SparseLoCo's accumulator: e ← β·e + Δ, then what is sent leaves it."""
    codec, feedback = TopKCodec(density=0.5, value_bits=32, chunk_size=2), ErrorFeedback(decay=0.5)
    x = torch.tensor([4.0, 1.0])
    first = codec.decode(codec.encode(feedback.compensate("k", x)))
    feedback.record("k", x, first)
    assert torch.equal(first, torch.tensor([4.0, 0.0])) and torch.equal(feedback.residuals["k"], torch.tensor([0.0, 1]))
    assert torch.equal(feedback.compensate("k", x), torch.tensor([4.0, 1.5]))
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=0.0)


def test_a_chunk_with_fewer_non_zeros_than_k_decodes_its_zeros_as_zeros():
    codec = TopKCodec(density=0.5, value_bits=2, chunk_size=8)  # k = 4 of 8, 3 non-zero (and a short last chunk)
    x = torch.tensor([0.0, 3.0, 0.0, -1.5, 0.0, 0.0, 3.0, 0.0, 0.0, 2.0])
    assert torch.equal(codec.decode(codec.encode(x)), torch.tensor([0.0, 3, 0, -1.5, 0, 0, 3, 0, 0, 2]))
    assert TopKCodec(density=0.07, chunk_size=100).k == 7  # not ⌈7.000000000000001⌉
