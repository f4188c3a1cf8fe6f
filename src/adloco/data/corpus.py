"""A corpus split into training and validation: in memory, streamed from its source, or token files."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adloco.data.sampling import WindowStream
from adloco.data.sources import DataError, Source, resolve_source, source_from_config
from adloco.data.streams import PackedStream, TokenStream, spread, validation_blocks
from adloco.data.token_files import TokenArray, TokenSource, names_token_files, open_token_source
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

    def validation_blocks(self, context: int, limit: int | None) -> torch.Tensor:
        return validation_blocks(self.val, context, limit)


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

    def validation_blocks(self, context: int, limit: int | None) -> torch.Tensor:
        return validation_blocks(self.val, context, limit)


@dataclass
class TokenCorpus:
    """Token files (a prepared folder, .bin or .npy files), read a window at a time: every worker reads the positions of
    one shared window order keyed by the run's ``seed`` (``adloco.data.sampling``)."""

    train: TokenArray
    val: TokenArray
    seed: int
    where: str
    largest_id: int  # the largest token id in the files

    @classmethod
    def load(cls, data: DataConfig, tokenizer: Tokenizer, context: int, seed: int) -> TokenCorpus:
        source = open_token_source(data.dataset, data.val_dataset, data.val_fraction, data.verify == "sha256")
        if source.val is None:
            raise DataError(f"data '{source.where}' has no validation tokens")
        check_vocabulary(source, tokenizer.vocab_size, f"the vocabulary of tokenizer '{tokenizer.name}'")
        corpus = cls(source.train, source.val, seed, source.where, source.max_id())
        for name, part in (("training", corpus.train), ("validation", corpus.val)):
            if len(part) < context + 1:
                raise DataError(
                    f"data '{source.where}': the {name} split has {len(part)} tokens, fewer than one context of "
                    f"{context} plus one"
                )
        return corpus

    def stream(self, context: int, seed: int, worker: int, workers: int) -> WindowStream:
        """Worker ``worker`` of ``workers`` (``seed``, the worker's own, is not used: the order is the run's)."""
        return WindowStream(self.train, context, self.seed, worker, workers)

    def validation_blocks(self, context: int, limit: int | None) -> torch.Tensor:
        """Non-overlapping windows over the validation tokens (``limit`` of them spread evenly), read from the
        files without loading the split."""
        starts = spread(self.val.windows(context), limit).numpy() * context
        return torch.from_numpy(self.val.gather(starts, context + 1))


def check_vocabulary(source: TokenSource, vocab_size: int, what: str) -> None:
    """Every id of the token files must be below ``vocab_size`` (an embedding has no row for the others)."""
    largest = source.max_id()
    if largest >= vocab_size:
        raise DataError(
            f"data '{source.where}' holds token id {largest:,}, at or above {what} ({vocab_size:,}); set "
            "data.tokenizer to the tokenizer that wrote the files"
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
    data: DataConfig, tokenizer: Tokenizer, context: int, source: Source | None = None, seed: int = 0
) -> Corpus | StreamingCorpus | TokenCorpus:
    """The corpus a ``DataConfig`` describes: in memory, streamed, or token files (their window order keyed by
    ``seed``)."""
    if source is None and names_token_files(data.dataset):
        return TokenCorpus.load(data, tokenizer, context, seed)
    source = source or source_from_config(data)
    if data.streaming:
        return StreamingCorpus.load(source, tokenizer, context, data.val_documents, data.shuffle_buffer)
    return Corpus.from_text(source.read_text(), tokenizer, data.val_fraction, context, source.location)
