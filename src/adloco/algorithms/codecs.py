"""Codecs for exchanged pseudo-gradients: float32 in, (codes, block scales) on the wire, float32 out.

Every payload is made of flat ``uint8`` tensors, so all formats travel through the same all-gather on gloo
and NCCL. The block formats (int8, fp8-e4m3, fp4-e2m1, fp4-e3m0) share one power-of-two scale per block of
``block_size`` elements, stored as a signed 8-bit exponent (the E8M0 scale of the OCP microscaling formats):
one byte per block instead of four, and scaling by a power of two is exact, which makes the codecs exactly
idempotent: decode(encode(decode(encode(x)))) == decode(encode(x)), bit for bit.

Error bounds, with s = 2^e the scale of the element's block (s < 2·absmax/top, where top is the format's
largest magnitude), for blocks whose absmax is at least top·2^-127:

- int8: |q(x) − x| ≤ s/2;
- fp8-e4m3: |q(x) − x| ≤ max(2⁻⁴·|x|, 2⁻¹⁰·s) (3 mantissa bits; subnormal step 2⁻⁹·s);
- fp4-e2m1: half the local grid spacing: s/4 below 2s, s/2 below 4s, s above;
- fp4-e3m0: to the nearest power of two, |q(x) − x| ≤ |x|/3, or ≤ 2⁻⁷·s below the smallest magnitude;
- bf16 / fp16: half an ulp, 2⁻⁸ / 2⁻¹¹ of |x| (fp16 below 2⁻¹⁴: half its 2⁻²⁴ subnormal step); both saturate
  at their largest finite value (fp16: 65504).

NaN and infinities are refused with ValueError, and so are magnitudes above 2^127 in the block formats
(rounding up to the grid could overflow float32 there). Blocks whose absmax is below top·2^-127 keep the
smallest scale 2^-127 and are quantized more coarsely than their size would allow (irrelevant in practice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0")
# 32 is the block of the OCP microscaling formats: a scale byte costs 1/32 byte per element (3 % for int8,
# 6 % for fp4), while one outlier only coarsens 31 neighbours.
DEFAULT_BLOCK_SIZE = 32

# Magnitudes representable by the 4-bit formats; the sign is a separate bit.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E3M0 = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)])  # 0, 2^-6, 2^-5, …, 2^-1, 1
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127
MAX_BLOCK_MAGNITUDE = 2.0**127  # largest |x| the block formats accept


@dataclass
class Encoded:
    """One rank's payload.

    ``codes`` is a flat uint8 tensor (two 4-bit codes per byte for fp4, low nibble first). ``scales`` is None
    for fp32/bf16/fp16; for block formats it holds one signed exponent e per block (the scale is 2^e), as
    int8 bits viewed as uint8. ``numel`` is the number of encoded elements.
    """

    codes: torch.Tensor
    scales: torch.Tensor | None
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire: codes plus scales."""
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.codes.numel() * self.codes.element_size() + scale_bytes


class Codec:
    """Base class of every format: ``encode`` a float tensor, ``decode`` back to float32."""

    name = ""
    bits = 32  # bits per element in ``codes``
    scaled = False  # whether the format carries one scale byte per block

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size})"

    def blocks(self, numel: int) -> int:
        """Number of scale blocks for ``numel`` elements (the last one may be partial)."""
        return math.ceil(numel / self.block_size)

    def code_bytes(self, numel: int) -> int:
        return math.ceil(numel * self.bits / 8)

    def encoded_nbytes(self, numel: int) -> int:
        """Size of ``encode`` of ``numel`` elements, known before encoding (to size all-gather buffers)."""
        return self.code_bytes(numel) + (self.blocks(numel) if self.scaled else 0)

    def encode(self, x: torch.Tensor) -> Encoded:
        """Flatten ``x``, convert to float32 and encode; NaN or infinity raises ValueError."""
        flat = x.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"codec {self.name}: cannot encode a tensor with NaN or infinite values")
        return self._encode(flat)

    def decode(self, encoded: Encoded, shape: torch.Size | Sequence[int] | None = None) -> torch.Tensor:
        """Float32 values of ``encoded``: flat, or reshaped to ``shape``."""
        self._check(encoded)
        out = self._decode(encoded)
        return out.reshape(tuple(shape)) if shape is not None else out

    def _check(self, encoded: Encoded) -> None:
        # A payload of the wrong size would otherwise decode silently into garbage or a confusing view error.
        if encoded.codes.dtype != torch.uint8 or encoded.codes.numel() != self.code_bytes(encoded.numel):
            raise ValueError(
                f"codec {self.name}: {encoded.numel} elements need {self.code_bytes(encoded.numel)} uint8 codes, "
                f"got {encoded.codes.numel()} of {encoded.codes.dtype}"
            )
        scales = 0 if encoded.scales is None else encoded.scales.numel()
        expected = self.blocks(encoded.numel) if self.scaled else 0
        if scales != expected:
            raise ValueError(f"codec {self.name}: expected {expected} block scales, got {scales}")
        if encoded.scales is not None and encoded.scales.dtype != torch.uint8:
            raise ValueError(
                f"codec {self.name}: block scales must be uint8 exponent bytes, got {encoded.scales.dtype}"
            )

    def _encode(self, flat: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        raise NotImplementedError


class _Cast(Codec):
    """Plain dtype conversion, the bits sent as bytes."""

    dtype = torch.float32

    def _encode(self, flat: torch.Tensor) -> Encoded:
        if self.dtype != torch.float32:
            # Saturate rather than round past the largest finite value to inf.
            limit = torch.finfo(self.dtype).max
            flat = flat.clamp(-limit, limit)
        cast = flat.to(self.dtype)
        if cast.data_ptr() == flat.data_ptr():
            cast = cast.clone()  # fp32: the payload must not alias the caller's tensor
        return Encoded(codes=cast.contiguous().view(torch.uint8), scales=None, numel=flat.numel())

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        return encoded.codes.contiguous().view(self.dtype).to(torch.float32, copy=True)


class Float32Codec(_Cast):
    """Identity: the float32 bits themselves (decode is bit-equal to the input)."""

    name, bits, dtype = "fp32", 32, torch.float32


class BFloat16Codec(_Cast):
    """bfloat16, rounded to nearest even."""

    name, bits, dtype = "bf16", 16, torch.bfloat16


class Float16Codec(_Cast):
    """float16, rounded to nearest even, saturating at ±65504."""

    name, bits, dtype = "fp16", 16, torch.float16


def block_exponents(blocks: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest e with absmax ≤ top·2^e per row of ``blocks``, clamped to the int8 range; −127 for zero rows."""
    absmax = blocks.abs().amax(dim=1).double()
    positive = absmax > 0
    guess = torch.ceil(torch.log2(torch.where(positive, absmax, 1.0) / top))
    # log2 may land one off near exact powers of two; fix with exact comparisons (float64, powers of two).
    guess = torch.where(absmax > top * torch.exp2(guess), guess + 1, guess)
    guess = torch.where(absmax <= top * torch.exp2(guess - 1), guess - 1, guess)
    exponent = torch.where(positive, guess, torch.full_like(guess, _MIN_EXPONENT))
    return exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT).to(torch.int8)


class _Blocked(Codec):
    """Shared machinery: scale each block by 2^-e so that its absmax fits ``top``, then quantize."""

    scaled = True
    top = 1.0

    def _blocks_of(self, flat: torch.Tensor) -> torch.Tensor:
        pad = self.blocks(flat.numel()) * self.block_size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block_size)

    def _encode(self, flat: torch.Tensor) -> Encoded:
        # Up to 2^127 every decoded value stays below top·2^e < 2·absmax ≤ 2^128, i.e. finite in float32.
        if flat.numel() and float(flat.abs().max()) > MAX_BLOCK_MAGNITUDE:
            raise ValueError(f"codec {self.name}: values beyond ±2^127 (~1.7e38) cannot be encoded")
        blocks = self._blocks_of(flat)
        exponents = block_exponents(blocks, self.top)
        scaled = blocks * torch.exp2(-exponents.to(torch.float32))[:, None]
        # Scaled values fit ±top by the choice of e; the clamp only guards against rounding surprises.
        codes = self._quantize(scaled.clamp(-self.top, self.top).reshape(-1)[: flat.numel()])
        return Encoded(codes=codes, scales=exponents.view(torch.uint8), numel=flat.numel())

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        assert encoded.scales is not None
        count = self.blocks(encoded.numel)
        values = self._dequantize(encoded.codes, encoded.numel)
        values = torch.nn.functional.pad(values, (0, count * self.block_size - encoded.numel))
        scale = torch.exp2(encoded.scales.view(torch.int8).to(torch.float32))
        return (values.view(count, self.block_size) * scale[:, None]).reshape(-1)[: encoded.numel].contiguous()

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError


class Int8Codec(_Blocked):
    """Symmetric integers in [−127, 127], stored as two's complement bytes (−128 is never produced)."""

    name, bits, top = "int8", 8, 127.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.round(scaled).to(torch.int8).view(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        return codes.view(torch.int8).to(torch.float32)


class Float8E4M3Codec(_Blocked):
    """OCP fp8 E4M3 (torch.float8_e4m3fn, largest finite 448), rounded to nearest even by torch."""

    name, bits, top = "fp8-e4m3", 8, 448.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).to(torch.float32)


class _Float4(_Blocked):
    """Sign bit (bit 3) + 3-bit index into a magnitude grid, two codes per byte (low nibble first)."""

    bits = 4
    grid = _E2M1

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size)
        self.top = float(self.grid[-1])
        self._midpoints = (self.grid[1:] + self.grid[:-1]) / 2

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        # Nearest grid magnitude; a tie goes to the larger magnitude (bucketize with right=True).
        index = torch.bucketize(scaled.abs(), self._midpoints.to(scaled.device), right=True).to(torch.uint8)
        # No sign on zero, so 0 and −0 share one code.
        nibble = index | (((scaled < 0) & (index > 0)).to(torch.uint8) << 3)
        if nibble.numel() % 2:
            nibble = torch.cat([nibble, nibble.new_zeros(1)])
        pairs = nibble.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _dequantize(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:numel]
        magnitude = self.grid.to(codes.device)[(nibbles & 0x07).long()]
        return torch.where((nibbles & 0x08) > 0, -magnitude, magnitude)


class Float4E2M1Codec(_Float4):
    """fp4 E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (block absmax → at most 6)."""

    name, grid = "fp4-e2m1", _E2M1


class Float4E3M0Codec(_Float4):
    """fp4 E3M0: no mantissa; magnitudes 0 and the powers of two 2^-6 … 2^0 (block absmax → at most 1)."""

    name, grid = "fp4-e3m0", _E3M0


_CODECS: dict[str, type[Codec]] = {
    "fp32": Float32Codec,
    "bf16": BFloat16Codec,
    "fp16": Float16Codec,
    "int8": Int8Codec,
    "fp8-e4m3": Float8E4M3Codec,
    "fp4-e2m1": Float4E2M1Codec,
    "fp4-e3m0": Float4E3M0Codec,
}


def get_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec called ``name`` (one of CODEC_NAMES); ``block_size`` only matters for block formats."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r} (choose from {', '.join(CODEC_NAMES)})")
    return _CODECS[name](block_size)


def decode_and_average(
    encoded_list: Sequence[Encoded],
    codec: Codec,
    shape: torch.Size | Sequence[int] | None = None,
    divisor: int | None = None,
) -> torch.Tensor:
    """Sum of the decoded payloads in float32 in list order (so every rank gets the same bits), divided by
    ``divisor`` (default: the number of payloads; a left-out worker sends zeros and is not counted)."""
    if not encoded_list:
        raise ValueError("decode_and_average needs at least one payload")
    total = codec.decode(encoded_list[0]).reshape(-1).clone()
    for encoded in encoded_list[1:]:
        total.add_(codec.decode(encoded).reshape(-1))
    total.div_(divisor or len(encoded_list))
    return total.reshape(tuple(shape)) if shape is not None else total


class ErrorFeedback:
    """Keeps what quantization dropped, per key, and adds it back to the next exchange of that key.

    ``decay`` β < 1 adds back β times the residual (SparseLoCo's accumulator e ← β·e + Δ, which stands in for outer
    momentum there); 1 adds it all.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """x plus the (decayed) residual left by the previous exchange of ``key`` (x itself the first time)."""
        residual = self.residuals.get(key)
        if residual is None:
            return x
        if residual.shape != x.shape:
            raise ValueError(f"error feedback {key!r}: residual shape {tuple(residual.shape)} != {tuple(x.shape)}")
        if self.decay != 1.0:
            return x + self.decay * residual.to(x.device)
        return x + residual.to(x.device)

    def record(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remember compensated − decoded: the part of this exchange the codec did not deliver."""
        self.residuals[key] = (compensated - decoded.to(compensated.device).reshape(compensated.shape)).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
