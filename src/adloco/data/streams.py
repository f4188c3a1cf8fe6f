"""Deterministic, resumable per-worker token streams: random windows in memory, or packed streaming."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from adloco.data.sources import DataError, Source
from adloco.data.tokenization import Tokenizer


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


class PackedStream:
    """One worker's share of a corpus read lazily: documents tokenized on the fly and packed into windows.

    Training documents (those after the first ``skip``, which are held out for validation) are dealt out
    round robin: training document i belongs to worker i mod ``workers``. Their tokens are packed
    back to back into windows of ``context + 1`` tokens (consecutive windows share one token, so every
    token is a target once per epoch); a buffer of ``shuffle_buffer`` windows, drawn from with the
    worker's generator, mixes neighbouring windows. At the end of the corpus the next epoch starts
    over. Memory is bounded by the shuffle buffer plus one document: the corpus is never held.

    The cursor (epoch, next document, tokens not yet in a window, the window buffer and the
    generator) is the whole state, so ``load_state_dict`` resumes bit-identically.
    """

    def __init__(
        self,
        source: Source,
        tokenizer: Tokenizer,
        context: int,
        seed: int,
        worker: int,
        workers: int,
        skip: int,
        shuffle_buffer: int = 1,
    ) -> None:
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of {workers}")
        self.source = source
        self.tokenizer = tokenizer
        self.context = context
        self.worker = worker
        self.workers = workers
        self.skip = skip
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.separator = "" if source.line_documents else source.separator
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.document = 0  # index (over all documents, validation ones included) of the next one to read
        self.epoch_tokens = 0  # tokens this worker read in the current epoch: zero at its end means no data
        self.pending = torch.zeros(0, dtype=torch.long)
        self.offset = 0  # start of the tokens in ``pending`` not yet in a window
        self.buffer: list[torch.Tensor] = []
        self._documents: Iterator[str] | None = None

    def _next_document(self) -> torch.Tensor:
        while True:
            if self._documents is None:
                self._documents = self.source.documents(start=self.document, streaming=True)
            text = next(self._documents, None)
            if text is None:
                self._end_epoch()
                continue
            index = self.document
            self.document += 1
            if index >= self.skip and (index - self.skip) % self.workers == self.worker:
                tokens = self.tokenizer.encode(text + self.separator)
                self.epoch_tokens += len(tokens)
                return tokens

    def _end_epoch(self) -> None:
        training = self.document - self.skip
        if training <= self.worker:
            raise DataError(
                f"data '{self.source.location}' has {max(training, 0)} training documents after the "
                f"{self.skip} held out for validation: too few for {self.workers} workers"
            )
        if self.epoch_tokens == 0:
            raise DataError(f"data '{self.source.location}': worker {self.worker}'s training documents have no tokens")
        self.epoch += 1
        self.document = 0
        self.epoch_tokens = 0
        self._documents = None

    def _packed_window(self) -> torch.Tensor:
        need = self.context + 1
        while len(self.pending) - self.offset < need:
            # Drop what is already in windows so that ``pending`` never grows past one document + a window.
            self.pending = torch.cat([self.pending[self.offset :], self._next_document()])
            self.offset = 0
        window = self.pending[self.offset : self.offset + need].clone()
        self.offset += self.context
        return window

    def _next_window(self) -> torch.Tensor:
        if self.shuffle_buffer == 1:
            return self._packed_window()
        while len(self.buffer) < self.shuffle_buffer:
            self.buffer.append(self._packed_window())
        pick = int(torch.randint(0, len(self.buffer), (1,), generator=self.generator))
        window = self.buffer[pick]
        self.buffer[pick] = self._packed_window()
        return window

    def next_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``size × context``: exactly one shift between them."""
        windows = torch.stack([self._next_window() for _ in range(size)])
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        buffer = torch.stack(self.buffer) if self.buffer else torch.zeros(0, self.context + 1, dtype=torch.long)
        return {
            "generator": self.generator.get_state(),
            "epoch": self.epoch,
            "document": self.document,
            "epoch_tokens": self.epoch_tokens,
            "pending": self.pending[self.offset :].clone(),
            "buffer": buffer,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.epoch = int(state["epoch"])
        self.document = int(state["document"])
        self.epoch_tokens = int(state["epoch_tokens"])
        self.pending = state["pending"].clone()
        self.offset = 0
        self.buffer = list(state["buffer"].clone())
        self._documents = None  # reopened at ``document`` on the next read


def spread(count: int, limit: int | None) -> torch.Tensor:
    """Indices of ``limit`` of ``count`` items drawn evenly across all of them (all with None or enough)."""
    if limit is None or limit >= count:
        return torch.arange(count)
    return torch.arange(limit) * count // limit


def validation_blocks(tokens: torch.Tensor, context: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of ``context + 1`` tokens over the validation split; with ``limit``, that many
    spread evenly across it, so a periodic evaluation estimates the same loss as the full one at the end."""
    starts = spread((len(tokens) - 1) // context, limit) * context
    return tokens[starts[:, None] + torch.arange(context + 1)]
