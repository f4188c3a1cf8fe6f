"""Codecs for exchanged pseudo-gradients: float32 in, (codes, block scales) on the wire, float32 out.

Every payload is a flat ``uint8`` tensor so that all formats travel through the same all-gather. The
block formats (int8, fp8-e4m3, fp4) share one power-of-two scale per block of ``block_size`` elements,
stored as a signed 8-bit exponent (as in the OCP microscaling formats). Power-of-two scales make scaling
exact, which gives exact idempotence: decode(encode(decode(encode(x)))) == decode(encode(x)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0")
DEFAULT_BLOCK_SIZE = 32

# Magnitudes representable by the 4-bit formats (sign is a separate bit).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E3M0 = torch.tensor([0.0] + [2.0**-e for e in range(6, -1, -1)])  # 0, 2^-6 … 2^0
_FP16_MAX = 65504.0


@dataclass
class Encoded:
    """One rank's payload: ``codes`` (uint8) and, for block formats, one int8 scale exponent per block."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    numel: int

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.codes.numel() * self.codes.element_size() + scale_bytes


def _check_finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot encode a tensor with NaN or infinite values")


class Codec:
    """Base class: subclasses define ``name``, ``bits`` and the element encoding."""

    name = ""
    bits = 32
    scaled = False

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def encoded_nbytes(self, numel: int) -> int:
        codes = math.ceil(numel * self.bits / 8)
        return codes + (self.blocks(numel) if self.scaled else 0)

    def encode(self, x: torch.Tensor) -> Encoded:
        flat = x.detach().reshape(-1).to(torch.float32)
        _check_finite(flat)
        return self._encode(flat)

    def decode(self, encoded: Encoded, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
        out = self._decode(encoded)
        return out.reshape(shape) if shape is not None else out

    def _encode(self, flat: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        raise NotImplementedError


class _Cast(Codec):
    dtype = torch.float32

    def _encode(self, flat: torch.Tensor) -> Encoded:
        if self.dtype == torch.float16:
            flat = flat.clamp(-_FP16_MAX, _FP16_MAX)  # saturate rather than overflow to inf
        codes = flat.to(self.dtype).contiguous().view(torch.uint8)
        return Encoded(codes=codes, scales=None, numel=flat.numel())

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        return encoded.codes.view(self.dtype).to(torch.float32)


class Float32Codec(_Cast):
    name, bits, dtype = "fp32", 32, torch.float32

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        return encoded.codes.view(torch.float32).clone()


class BFloat16Codec(_Cast):
    name, bits, dtype = "bf16", 16, torch.bfloat16


class Float16Codec(_Cast):
    name, bits, dtype = "fp16", 16, torch.float16


class _Blocked(Codec):
    """Shared machinery: per-block power-of-two scale so that the block's absmax fits ``top``."""

    scaled = True
    top = 1.0

    def _blocks_of(self, flat: torch.Tensor) -> torch.Tensor:
        pad = self.blocks(flat.numel()) * self.block_size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block_size)

    def _exponents(self, blocks: torch.Tensor) -> torch.Tensor:
        absmax = blocks.abs().amax(dim=1)
        exponent = torch.ceil(torch.log2(absmax / self.top))
        exponent = torch.where(absmax > 0, exponent, torch.full_like(exponent, -127.0))
        return exponent.clamp(-127, 127).to(torch.int8)

    def _encode(self, flat: torch.Tensor) -> Encoded:
        blocks = self._blocks_of(flat)
        exponents = self._exponents(blocks)
        scaled = blocks / torch.exp2(exponents.to(torch.float32))[:, None]
        codes = self._quantize(scaled.clamp(-self.top, self.top)).reshape(-1)[: self._code_count(flat.numel())]
        return Encoded(codes=codes, scales=exponents.view(torch.uint8), numel=flat.numel())

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        assert encoded.scales is not None
        count = self.blocks(encoded.numel)
        values = self._dequantize(encoded.codes, count * self.block_size).view(count, self.block_size)
        scale = torch.exp2(encoded.scales.view(torch.int8).to(torch.float32))
        return (values * scale[:, None]).reshape(-1)[: encoded.numel].contiguous()

    def _code_count(self, numel: int) -> int:
        return math.ceil(numel * self.bits / 8)

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, count: int) -> torch.Tensor:
        raise NotImplementedError


class Int8Codec(_Blocked):
    """Symmetric integers in [-127, 127] (two's complement in a byte)."""

    name, bits, top = "int8", 8, 127.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.round(scaled).to(torch.int8).view(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, count: int) -> torch.Tensor:
        values = codes.view(torch.int8).to(torch.float32)
        return torch.nn.functional.pad(values, (0, count - values.numel()))


class Float8E4M3Codec(_Blocked):
    """OCP fp8 E4M3 (largest finite value 448), rounded to nearest even by torch."""

    name, bits, top = "fp8-e4m3", 8, 448.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, count: int) -> torch.Tensor:
        values = codes.view(torch.float8_e4m3fn).to(torch.float32)
        return torch.nn.functional.pad(values, (0, count - values.numel()))


class _Float4(_Blocked):
    """Sign bit + 3-bit index into a magnitude grid, two codes per byte (low nibble first)."""

    bits = 4
    grid = _E2M1

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size)
        self.top = float(self.grid[-1])
        self._midpoints = (self.grid[1:] + self.grid[:-1]) / 2

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        flat = scaled.reshape(-1)
        # Nearest grid magnitude; a tie goes to the larger magnitude (bucketize's right=True).
        index = torch.bucketize(flat.abs(), self._midpoints, right=True).to(torch.uint8)
        nibble = index | ((flat < 0) & (index > 0)).to(torch.uint8) << 3
        if nibble.numel() % 2:
            nibble = torch.cat([nibble, torch.zeros(1, dtype=torch.uint8)])
        pairs = nibble.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _dequantize(self, codes: torch.Tensor, count: int) -> torch.Tensor:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)[:count]
        magnitude = self.grid[(nibbles & 0x07).long()]
        values = torch.where((nibbles & 0x08) > 0, -magnitude, magnitude)
        return torch.nn.functional.pad(values, (0, count - values.numel()))


class Float4E2M1Codec(_Float4):
    """fp4 E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""

    name, grid = "fp4-e2m1", _E2M1


class Float4E3M0Codec(_Float4):
    """fp4 E3M0: no mantissa; magnitudes 0 and the powers of two 2^-6 … 2^0."""

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
    if name not in _CODECS:
        raise ValueError(f"unknown codec '{name}' (choose from {', '.join(CODEC_NAMES)})")
    return _CODECS[name](block_size)


class ErrorFeedback:
    """Keeps what quantization dropped and adds it back to the next exchange of the same key."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(key)
        return x if residual is None else x + residual.to(x.device)

    def record(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        self.residuals[key] = (compensated - decoded.to(compensated.device)).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
