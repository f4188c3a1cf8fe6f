"""Corpora, tokenizers and deterministic, resumable per-worker token streams."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

BUNDLED = {"tinyshakespeare": "tinyshakespeare.txt.gz"}


class DataError(ValueError):
    """A data file that cannot be used, reported as one line."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no special tokens, lossless on any text."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> torch.Tensor:
        raw = text.encode("utf-8")
        if not raw:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size, "encoding": "utf-8"}


def get_tokenizer(name: str) -> ByteTokenizer:
    if name == "byte":
        return ByteTokenizer()
    raise DataError(f"unknown tokenizer '{name}'")


def read_text(dataset: str) -> str:
    """The bundled corpus by name, or a UTF-8 text file by path."""
    if dataset in BUNDLED:
        blob = resources.files(__package__).joinpath(BUNDLED[dataset]).read_bytes()
        return gzip.decompress(blob).decode("ascii")
    path = Path(dataset)
    if not path.exists():
        raise DataError(f"data file '{dataset}' does not exist (bundled datasets: {', '.join(BUNDLED)})")
    if not path.is_file():
        raise DataError(f"data path '{dataset}' is not a file")
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise DataError(f"data file '{dataset}' looks binary (it contains NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"data file '{dataset}' is not UTF-8 text (byte {error.start})") from None


def dataset_label(dataset: str) -> str:
    return dataset if dataset in BUNDLED else Path(dataset).stem


@dataclass
class Corpus:
    """Token ids of a text split into a training part and a trailing validation part."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, dataset: str, tokenizer: ByteTokenizer, val_fraction: float, context: int) -> Corpus:
        ids = tokenizer.encode(read_text(dataset))
        split = int(len(ids) * (1 - val_fraction))
        train, val = ids[:split], ids[split:]
        for name, part in (("training", train), ("validation", val)):
            if len(part) < context + 1:
                raise DataError(
                    f"data '{dataset}': the {name} split has {len(part)} tokens, fewer than one context "
                    f"of {context} plus one"
                )
        return cls(train=train, val=val)


class TokenStream:
    """One worker's endless, deterministic stream of training windows.

    Each sample is a window of ``context + 1`` consecutive tokens at a uniformly drawn offset, so any
    batch size works and can change between rounds. The generator state is the whole cursor: saving it
    and restoring it resumes the stream exactly.
    """

    def __init__(self, tokens: torch.Tensor, context: int, seed: int) -> None:
        self.tokens = tokens
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)
        self._arange = torch.arange(context + 1)

    def next_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``size × context``: exactly one shift between them."""
        high = len(self.tokens) - self.context
        offsets = torch.randint(0, high, (size,), generator=self.generator)
        windows = self.tokens[offsets[:, None] + self._arange]
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def validation_blocks(tokens: torch.Tensor, context: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of ``context + 1`` tokens covering the validation split (first ``limit``)."""
    count = (len(tokens) - 1) // context
    if limit is not None:
        count = min(count, limit)
    starts = torch.arange(count) * context
    return tokens[starts[:, None] + torch.arange(context + 1)]
