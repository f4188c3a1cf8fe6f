"""A sparse codec for pseudo-gradients (SparseLoCo, arXiv 2508.15706): per chunk of ``chunk_size`` elements only
the ``k`` largest magnitudes travel, each as its index in the chunk and a few bits of value.

Payload of one worker, all ``uint8`` so it rides the all-gather every codec uses:
- codes: the k indices of every chunk at ⌈log2 chunk_size⌉ bits each, then their values at ``value_bits`` each
  (a sign bit and a magnitude level; 32 sends the float32 bits themselves), both packed without gaps;
- scales: one float32 per chunk, the chunk's largest magnitude (its four bytes); none at 32 bits.
k = ⌈density · chunk_size⌉ for every chunk (the last one is padded with zeros), so the size is known before
encoding. The value levels are m·j/L for j = 1 … L, L = 2^(value_bits − 1), m the chunk's absmax: a kept value is
off by at most m/(2L) (by less than m/L where it is below m/(2L)); a chunk with fewer than k non-zero entries
repeats its largest one in the spare slots, so its zeros decode as zeros. What is not sent (the other entries and the
rounding) is what error feedback carries to the next round, and why it is on by default with this codec.
"""

from __future__ import annotations

import math

import torch

from adloco.algorithms.codecs import Codec, Encoded

DEFAULT_CHUNK = 4096  # SparseLoCo's 64×64 chunks: 12-bit indices


_PIECE = 1 << 18  # values packed at a time: bounds the bit-by-bit temporaries (a multiple of 8, so pieces join)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below 2^bits (at most 2^16 here), packed low bit first into ⌈len·bits/8⌉ bytes."""
    flat = values.reshape(-1).to(torch.int32)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int32)
    weights = (1 << torch.arange(8, device=values.device)).to(torch.uint8)
    pieces = []
    for start in range(0, max(flat.numel(), 1), _PIECE):
        stream = ((flat[start : start + _PIECE, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
        stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
        pieces.append((stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8))
    return torch.cat(pieces)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` integers ``pack_bits`` packed, as int64."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    pieces = []
    for start in range(0, count, _PIECE):
        size = min(_PIECE, count - start)
        chunk = packed[start * bits // 8 : (start * bits + size * bits + 7) // 8]
        stream = ((chunk[:, None] >> shifts) & 1).reshape(-1)[: size * bits]
        pieces.append((stream.view(size, bits).to(torch.int32) * weights).sum(dim=1))
    return torch.cat(pieces).long() if pieces else torch.zeros(0, dtype=torch.long, device=packed.device)


class TopKCodec(Codec):
    """Chunked top-k with ``value_bits``-bit values (2 to 8, or 32 for exact float32 values)."""

    name = "topk"

    def __init__(self, density: float = 0.01, value_bits: int = 2, chunk_size: int = DEFAULT_CHUNK) -> None:
        super().__init__(chunk_size)
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if value_bits != 32 and not 2 <= value_bits <= 8:
            raise ValueError(f"value_bits must be 2 to 8, or 32, got {value_bits}")
        self.density, self.value_bits = density, value_bits
        self.k = min(chunk_size, math.ceil(round(density * chunk_size, 9)))  # 0.07·100 is 7, not 8
        self.index_bits = max(1, math.ceil(math.log2(chunk_size)))
        self.levels = 2 ** (value_bits - 1)

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density}, value_bits={self.value_bits}, chunk_size={self.block_size})"

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """Bytes of the packed indices, the packed values and the chunk scales of ``numel`` elements."""
        kept = self.blocks(numel) * self.k
        scales = 0 if self.value_bits == 32 else 4 * self.blocks(numel)
        return math.ceil(kept * self.index_bits / 8), math.ceil(kept * self.value_bits / 8), scales

    def code_bytes(self, numel: int) -> int:
        indices, values, _ = self._sizes(numel)
        return indices + values

    def encoded_nbytes(self, numel: int) -> int:
        return sum(self._sizes(numel))

    def _check(self, encoded: Encoded) -> None:
        indices, values, scales = self._sizes(encoded.numel)
        got_scales = 0 if encoded.scales is None else encoded.scales.numel()
        if encoded.codes.dtype != torch.uint8 or encoded.codes.numel() != indices + values or got_scales != scales:
            raise ValueError(
                f"codec topk: {encoded.numel} elements need {indices + values} code and {scales} scale bytes, got "
                f"{encoded.codes.numel()} of {encoded.codes.dtype} and {got_scales}"
            )

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        pad = self.blocks(flat.numel()) * self.block_size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block_size)

    def _encode(self, flat: torch.Tensor) -> Encoded:
        chunks = self._chunks(flat)
        picked = chunks.abs().topk(self.k, dim=1, sorted=True).indices
        values = chunks.gather(1, picked)
        # A chunk with fewer than k non-zero entries picks zeros, which no value level can say (the levels start at
        # m/L): such a pick repeats the chunk's largest entry (picked first), which decodes to the same place.
        zero = values == 0
        picked = torch.where(zero, picked[:, :1], picked)
        values = torch.where(zero, values[:, :1], values)
        codes = [pack_bits(picked, self.index_bits)]
        if self.value_bits == 32:
            codes.append(values.contiguous().view(torch.uint8).reshape(-1))
            return Encoded(codes=torch.cat(codes), scales=None, numel=flat.numel())
        absmax = values.abs().amax(dim=1, keepdim=True)
        level = torch.round(values.abs() / torch.where(absmax > 0, absmax, 1.0) * self.levels).clamp(1, self.levels)
        sign = (values < 0).long() << (self.value_bits - 1)
        codes.append(pack_bits((level.long() - 1) | sign, self.value_bits))
        scales = absmax.reshape(-1).contiguous().view(torch.uint8)
        return Encoded(codes=torch.cat(codes), scales=scales, numel=flat.numel())

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        chunks = self.blocks(encoded.numel)
        index_bytes, _, _ = self._sizes(encoded.numel)
        kept = chunks * self.k
        picked = unpack_bits(encoded.codes[:index_bytes], self.index_bits, kept).view(chunks, self.k)
        packed = encoded.codes[index_bytes:]
        if self.value_bits == 32:
            values = packed.clone().view(torch.float32).view(chunks, self.k)  # clone: aligned for the view
        else:
            assert encoded.scales is not None
            raw = unpack_bits(packed, self.value_bits, kept).view(chunks, self.k)
            magnitude = ((raw & (self.levels - 1)) + 1).to(torch.float32) / self.levels
            absmax = encoded.scales.clone().view(torch.float32).view(chunks, 1)
            values = torch.where(raw >= self.levels, -magnitude, magnitude) * absmax
        out = torch.zeros(chunks, self.block_size, device=encoded.codes.device)
        out.scatter_(1, picked, values)
        return out.reshape(-1)[: encoded.numel].contiguous()
