"""A corpus split into training and validation: in memory, or streamed from its source."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adloco.data.sources import DataError, Source, resolve_source, source_from_config
from adloco.data.streams import PackedStream, TokenStream
from adloco.data.tokenization import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from adloco.config import DataConfig


def _check_split(where: str, name: str, part: torch.Tensor, context: int) -> None:
    if len(part) < context + 1:
        raise DataError(
            f"data '{where}': the {name} split has {len(part)} tokens, fewer than one context of {context} plus one"
        )


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """The leading training part and the trailing validation part of a text, cut by characters."""
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


@dataclass
class Corpus:
    """Token ids of a text split into a training part and a trailing validation part."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, dataset: str | Source, tokenizer: Tokenizer, val_fraction: float, context: int) -> Corpus:
        source = resolve_source(dataset) if isinstance(dataset, str) else dataset
        return cls.from_text(source.read_text(), tokenizer, val_fraction, context, source.location)

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer, val_fraction: float, context: int, where: str) -> Corpus:
        if isinstance(tokenizer, ByteTokenizer):
            # Bytes split by token count (what the byte-level runs have always done).
            ids = tokenizer.encode(text)
            split = int(len(ids) * (1 - val_fraction))
            train, val = ids[:split], ids[split:]
        else:
            # A trained tokenizer learnt from the training characters only, so the text is cut first.
            train_text, val_text = split_text(text, val_fraction)
            train, val = tokenizer.encode(train_text), tokenizer.encode(val_text)
        for name, part in (("training", train), ("validation", val)):
            _check_split(where, name, part, context)
        return cls(train=train, val=val)

    def stream(self, context: int, seed: int, worker: int, workers: int) -> TokenStream:
        """A worker's stream of uniformly drawn windows (every worker samples the whole training split)."""
        return TokenStream(self.train, context, seed)


@dataclass
class StreamingCorpus:
    """A corpus read lazily: the first ``val_documents`` documents are the validation split, held in
    memory; the training documents are only read by the workers' streams."""

    source: Source
    tokenizer: Tokenizer
    val: torch.Tensor
    val_documents: int
    shuffle_buffer: int

    @classmethod
    def load(
        cls, source: Source, tokenizer: Tokenizer, context: int, val_documents: int, shuffle_buffer: int
    ) -> StreamingCorpus:
        separator = "" if source.line_documents else source.separator
        documents = source.documents(streaming=True)
        held_out = []
        for _ in range(val_documents):
            text = next(documents, None)
            if text is None:
                break
            held_out.append(tokenizer.encode(text + separator))
        if len(held_out) < val_documents or next(documents, None) is None:
            raise DataError(
                f"data '{source.location}' has {len(held_out)} documents; streaming holds out the first "
                f"{val_documents} for validation (data.val_documents) and needs more to train on"
            )
        val = torch.cat(held_out)
        _check_split(source.location, "validation", val, context)
        return cls(source, tokenizer, val, val_documents, shuffle_buffer)

    def stream(self, context: int, seed: int, worker: int, workers: int) -> PackedStream:
        """Worker ``worker`` of ``workers``: its own round-robin share of the training documents."""
        return PackedStream(
            self.source, self.tokenizer, context, seed, worker, workers, self.val_documents, self.shuffle_buffer
        )


def training_texts(data: DataConfig, source: Source | None = None) -> Iterator[str]:
    """The training split as texts, for training a tokenizer (lazily when streaming)."""
    source = source or source_from_config(data)
    if data.streaming:
        separator = "" if source.line_documents else source.separator
        for index, text in enumerate(source.documents(streaming=True)):
            if index >= data.val_documents:
                yield text + separator
    else:
        yield split_text(source.read_text(), data.val_fraction)[0]


def load_corpus(
    data: DataConfig, tokenizer: Tokenizer, context: int, source: Source | None = None
) -> Corpus | StreamingCorpus:
    """The corpus a ``DataConfig`` describes, in memory or streamed."""
    source = source or source_from_config(data)
    if data.streaming:
        return StreamingCorpus.load(source, tokenizer, context, data.val_documents, data.shuffle_buffer)
    return Corpus.from_text(source.read_text(), tokenizer, data.val_fraction, context, source.location)
