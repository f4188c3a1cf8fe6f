"""A source read as the documents and pieces ``adloco prepare`` tokenizes: a folder's files, JSON Lines, Parquet or
dataset rows, or one text file cut into pieces after line ends; which documents are held out for validation; how
big the source is (for the ETA)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from adloco.data.sources import TEXT_SUFFIXES, Source, decode_text, first_line, folder_files, read_text_file
from adloco.errors import DataError

PIECE_BYTES = 1 << 20  # a single text file is tokenized in pieces of about this size, cut after a line end
LONG_LINE_BYTES = 4 * PIECE_BYTES  # a line longer than this is cut at a space instead


@dataclass(frozen=True)
class PrepareSettings:
    """What ``adloco prepare`` was asked for; all but ``processes`` decide the output, so a rerun with the same
    ones resumes (or finds the work done), and one with others is refused."""

    source: str
    tokenizer: str = "bpe"
    vocab_size: int = 32768
    bpe_chars: int = 100_000_000
    bpe_every: int = 1
    shard_tokens: int = 100_000_000
    val_documents: int = 1000
    val_every: int = 100
    val_fraction: float = 0.1
    text_field: str = "text"
    hf_config: str | None = None
    hf_data_files: str | None = None
    split: str = "train"
    suffixes: tuple[str, ...] = TEXT_SUFFIXES
    processes: int = field(default=1, compare=False)

    def identity(self) -> dict[str, Any]:
        """The settings that decide the output, as the manifest records them."""
        data = asdict(self)
        data.pop("processes")
        data["suffixes"] = list(self.suffixes)
        return data

    def check(self) -> None:
        for name in ("vocab_size", "bpe_chars", "bpe_every", "shard_tokens", "val_documents", "val_every", "processes"):
            if getattr(self, name) < 1:
                raise DataError(f"prepare: --{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.tokenizer == "bpe" and self.vocab_size < 258:
            raise DataError(f"prepare: a bpe vocabulary needs at least 258 entries, got {self.vocab_size}")
        if not 0 < self.val_fraction < 1:
            raise DataError(f"prepare: --val-fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class Piece:
    """Part of a document: ``piece`` of document ``doc`` in ``split``; ``last`` ends the document."""

    split: str
    doc: int
    piece: int
    last: bool
    text: str


# -- documents --------------------------------------------------------------------------------------------------
def _file_pieces(path: Path, start: int = 0, stop: int | None = None) -> Iterator[str]:
    """Bytes [start, stop) of a UTF-8 file as texts of about PIECE_BYTES, each cut after a line end."""
    with path.open("rb") as handle:
        handle.seek(start)
        left = (stop if stop is not None else path.stat().st_size) - start
        carry = b""
        while left > 0:
            block = handle.read(min(PIECE_BYTES, left))
            if not block:
                break
            left -= len(block)
            block = carry + block
            cut = block.rfind(b"\n") + 1 if left > 0 else len(block)
            if cut == 0 and len(block) < LONG_LINE_BYTES:  # a line longer than a piece: read on
                carry = block
                continue
            if cut == 0:  # a line of megabytes: cut at its last space, else between two characters
                cut = block.rfind(b" ") + 1 or _character_start(block, len(block) - 1)
            carry = block[cut:]
            yield decode_text(block[:cut], f"data file '{path}'")
        if carry:
            yield decode_text(carry, f"data file '{path}'")


def _character_start(raw: bytes, at: int) -> int:
    """The offset of the UTF-8 character that holds byte ``at`` (continuation bytes are 0b10xxxxxx)."""
    while at > 0 and raw[at] & 0xC0 == 0x80:
        at -= 1
    return at


def _line_cut(path: Path, fraction: float) -> int:
    """The byte offset of the first line start at or after ``fraction`` of the file."""
    size = path.stat().st_size
    target = int(size * fraction)
    with path.open("rb") as handle:
        handle.seek(target)
        if target == 0:
            return 0
        handle.seek(target - 1)
        while True:
            block = handle.read(1 << 16)
            if not block:
                return size
            newline = block.find(b"\n")
            if newline >= 0:
                return handle.tell() - len(block) + newline + 1


def _single_document(source: Source, settings: PrepareSettings) -> Iterator[Piece]:
    """A text file (or the bundled corpus): its leading part the training document 0, its trailing
    ``val_fraction`` (cut at a line start) the validation document 1."""
    if source.kind == "bundled":
        from adloco.data.sources import bundled_text

        text = bundled_text(source.location)
        cut = len(text) - int(len(text) * settings.val_fraction)
        cut = text.rfind("\n", 0, cut) + 1 or cut
        parts = [("train", iter([text[:cut]])), ("val", iter([text[cut:]]))]
    else:
        path = Path(source.location)
        cut = _line_cut(path, 1 - settings.val_fraction)
        parts = [("train", _file_pieces(path, 0, cut)), ("val", _file_pieces(path, cut))]
    for doc, (split, texts) in enumerate(parts):
        previous = next(texts, "")
        index = 0
        for text in texts:
            yield Piece(split, doc, index, False, previous)
            previous, index = text, index + 1
        yield Piece(split, doc, index, True, previous)


def _documents(source: Source, settings: PrepareSettings, skipped: list[str] | None) -> Iterator[str]:
    """The source's documents; with ``skipped``, folder files that are binary or not UTF-8 are left out and named
    there rather than stopping the prepare."""
    if source.kind != "folder":
        yield from source.documents(streaming=True)
        return
    for path in _listing(source.location, settings.suffixes):
        try:
            yield read_text_file(path)
        except (DataError, OSError) as error:
            if skipped is None:
                raise DataError(f"prepare: {first_line(error)}") from None
            skipped.append(str(path.relative_to(source.location)))


@cache
def _listing(folder: str, suffixes: tuple[str, ...]) -> list[Path]:
    """A folder's files, listed once per prepare (a large tree takes seconds to walk)."""
    return folder_files(Path(folder), suffixes)


def pieces(source: Source, settings: PrepareSettings, skip_unreadable: bool = False,
            skipped: list[str] | None = None) -> Iterator[Piece]:  # fmt: skip
    """Every piece of the source in order, with the split its document belongs to."""
    if source.kind in ("bundled", "text"):
        yield from _single_document(source, settings)
        return
    held_out = 0
    sink = skipped if skipped is not None else ([] if skip_unreadable else None)
    for doc, text in enumerate(_documents(source, settings, sink)):
        is_val = held_out < settings.val_documents and doc % settings.val_every == 0
        held_out += is_val
        yield Piece("val" if is_val else "train", doc, 0, True, text)


def source_size(source: Source, settings: PrepareSettings) -> int | None:
    """Bytes of the source's files (for an ETA), None when unknown (a dataset)."""
    if source.kind in ("text", "jsonl", "parquet"):
        return Path(source.location).stat().st_size
    if source.kind == "folder":
        return sum(p.stat().st_size for p in _listing(source.location, settings.suffixes))
    if source.kind == "bundled":
        from adloco.data.sources import bundled_text

        return len(bundled_text(source.location).encode())
    return None
