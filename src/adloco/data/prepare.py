"""``adloco prepare``: a text source tokenized once into shards of token ids that training reads a window at a time.

The source is read in order as documents (a folder's files, a JSON Lines, Parquet or ``datasets`` row each; a
single text file is one document, read in pieces cut at line ends). Every ``val_every``-th document is held out for
validation until ``val_documents`` are (a single-document source holds out its trailing ``val_fraction``
instead). Tokenizing processes encode batches of pieces with Hugging Face ``tokenizers`` and an end-of-document id
follows each document. Each split's tokens are cut into shards of ``shard_tokens``, each staged and renamed, and
the manifest is rewritten after every shard with where that shard ends in the source, so that a prepare that was
killed, or ran out of disk, resumes by redoing only the shard it was writing. The output does not depend on the
number of tokenizing processes.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from adloco.data.prepare_progress import PrepareProgress
from adloco.data.sources import (
    TEXT_SUFFIXES,
    Source,
    decode_text,
    first_line,
    folder_files,
    read_text_file,
    resolve_source,
)
from adloco.data.token_files import (
    DTYPES,
    MANIFEST,
    TOKENIZER_DIR,
    Manifest,
    ShardRecord,
    dtype_for,
    read_manifest,
    shard_name,
    tokenizer_digest,
    write_manifest,
    write_tokens,
)
from adloco.errors import DataError

PIECE_BYTES = 1 << 20  # a single text file is tokenized in pieces of about this size, cut after a line end
LONG_LINE_BYTES = 4 * PIECE_BYTES  # a line longer than this is cut at a space instead
BATCH_BYTES = 1 << 20  # text per batch sent to a tokenizing process
BYTE_EOT = 0  # the byte tokenizer's end of document: NUL, which no text source holds (they are refused)


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


def _say(console: Any, message: str) -> None:
    console.print(f"adloco: {message}", markup=False, highlight=False, soft_wrap=True)


# -- tokenizers -------------------------------------------------------------------------------------------------
@dataclass
class TokenizerPlan:
    """The tokenizer the shards are written with: ``type`` byte, bpe or hf; ``file`` its tokenizer.json."""

    type: str
    origin: str
    vocab_size: int
    eot_id: int
    file: str | None = None
    sha256: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"type": self.type, "origin": self.origin, "vocab_size": self.vocab_size,
                "dir": None if self.file is None else TOKENIZER_DIR, "sha256": self.sha256}  # fmt: skip


def _eot_of(tokenizer: Any, spec: str) -> int:
    inner = tokenizer.tokenizer
    for token_id in (inner.eos_token_id, inner.bos_token_id):
        if isinstance(token_id, int):
            return token_id
    raise DataError(f"prepare: tokenizer '{spec}' has no end-of-text (eos) token to put between documents")


def _plan_tokenizer(settings: PrepareSettings, source: Source, out: Path, console: Any) -> TokenizerPlan:
    """Train, load or take the tokenizer and save it into ``out/tokenizer`` (a byte tokenizer needs no files)."""
    if settings.tokenizer == "byte":
        return TokenizerPlan("byte", "byte", 256, BYTE_EOT)
    from adloco.data.tokenization import load_pretrained, train_bpe

    if settings.tokenizer == "bpe":
        _say(
            console,
            f"training a byte-level BPE of {settings.vocab_size:,} on at most {settings.bpe_chars:,} "
            "characters of the source",
        )
        started = time.perf_counter()
        tokenizer = train_bpe(_bpe_sample(source, settings), settings.vocab_size)
        _say(console, f"BPE trained in {time.perf_counter() - started:.1f} s")
    else:
        tokenizer = load_pretrained(settings.tokenizer)
        if not getattr(tokenizer.tokenizer, "is_fast", False):
            raise DataError(f"prepare: tokenizer '{settings.tokenizer}' has no fast (tokenizers) version")
    eot = _eot_of(tokenizer, settings.tokenizer)
    staging = out / f".{TOKENIZER_DIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save(staging)
    shutil.rmtree(out / TOKENIZER_DIR, ignore_errors=True)
    staging.rename(out / TOKENIZER_DIR)
    folder = out / TOKENIZER_DIR
    kind = "bpe" if settings.tokenizer == "bpe" else "hf"
    return TokenizerPlan(kind, settings.tokenizer, tokenizer.vocab_size, eot, str(folder / "tokenizer.json"),
                         tokenizer_digest(folder))  # fmt: skip


def _bpe_sample(source: Source, settings: PrepareSettings) -> Iterator[str]:
    """Every ``bpe_every``-th training piece until ``bpe_chars`` characters (validation documents left out)."""
    used, index = 0, 0
    for piece in _pieces(source, settings, skip_unreadable=True):
        if piece.split != "train":
            continue
        if index % settings.bpe_every == 0:
            text = piece.text[: settings.bpe_chars - used]
            yield text
            used += len(text)
            if used >= settings.bpe_chars:
                return
        index += 1


class _Encoder:
    """Turns pieces into token ids (an end-of-document id after a document's last piece); one per process.
    ``engine``: byte, tiktoken (a byte-level BPE converted, see ``fast_encoding``) or tokenizers."""

    def __init__(self, engine: str, file: str | None, eot: int, dtype: str) -> None:
        self.engine, self.eot, self.dtype = engine, eot, DTYPES[dtype]
        self.core: Any = None
        if engine == "tiktoken":
            from adloco.data.fast_encoding import tiktoken_encoding

            self.core = tiktoken_encoding(file)
        elif engine == "tokenizers":
            from tokenizers import Tokenizer

            self.core = Tokenizer.from_file(file)
            self.core.encode_special_tokens = True  # "<|endoftext|>" written in a text is text, as tiktoken reads it

    def ids(self, texts: list[str]) -> list[np.ndarray]:
        if self.engine == "byte":
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(self.dtype) for t in texts]
        if self.engine == "tiktoken":
            return [np.array(self.core.encode_ordinary(t), dtype=self.dtype) for t in texts]
        return [np.array(e.ids, dtype=self.dtype) for e in self.core.encode_batch(texts, add_special_tokens=False)]

    def encode(self, pieces: list[Piece]) -> list[tuple[Piece, np.ndarray, int]]:
        """Each piece with its ids and the bytes of text it held."""
        ids = self.ids([p.text for p in pieces])
        eot = np.array([self.eot], dtype=self.dtype)
        return [(p, np.concatenate([i, eot]) if p.last else i, len(p.text.encode("utf-8")))
                for p, i in zip(pieces, ids, strict=True)]  # fmt: skip


SAMPLE_CHARS = 2_000_000  # text both encoders tokenize before tiktoken is trusted with a source


def choose_engine(kind: str, file: str | None, pieces: Iterator[Piece]) -> str:
    """tiktoken where the tokenizer converts and gives the same ids as ``tokenizers`` on the source's first pieces
    (about SAMPLE_CHARS of text), else ``tokenizers``; bytes need neither."""
    if kind == "byte":
        return "byte"
    from adloco.data.fast_encoding import tiktoken_encoding

    if file is None or tiktoken_encoding(file) is None:
        return "tokenizers"
    sample, size = [], 0
    for piece in pieces:
        sample.append(piece.text)
        size += len(piece.text)
        if size >= SAMPLE_CHARS:
            break
    fast, exact = _Encoder("tiktoken", file, 0, "uint32"), _Encoder("tokenizers", file, 0, "uint32")
    same = all(np.array_equal(a, b) for a, b in zip(fast.ids(sample), exact.ids(sample), strict=True))
    return "tiktoken" if same else "tokenizers"


_ENCODER: _Encoder | None = None


def _start_encoder(kind: str, file: str | None, eot: int, dtype: str) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = _Encoder(kind, file, eot, dtype)


def _encode_in_process(pieces: list[Piece]) -> list[tuple[Piece, np.ndarray, int]]:
    assert _ENCODER is not None
    return _ENCODER.encode(pieces)


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


def _pieces(source: Source, settings: PrepareSettings, skip_unreadable: bool = False,
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


# -- shards -----------------------------------------------------------------------------------------------------
class ShardWriter:
    """One split's tokens, written in shards of ``size`` tokens as they fill; ``records`` are the shards done."""

    def __init__(self, out: Path, split: str, size: int, records: list[ShardRecord]) -> None:
        self.out, self.split, self.size, self.records = out, split, size, records
        self.chunks: list[np.ndarray] = []
        self.held = 0  # tokens in ``chunks``
        self.documents = 0  # documents that ended in ``chunks``
        # (doc, piece, tokens of that piece) at the end of the last shard written: what a resume skips
        self.resume_at = tuple(records[-1].ends_at) if records else (-1, 0, 0)
        self.position = self.resume_at

    def skips(self, piece: Piece) -> int | None:
        """Tokens of ``piece`` already in a shard: None when all of them, else how many to drop."""
        doc, index, taken = self.resume_at
        if (piece.doc, piece.piece) < (doc, index):
            return None
        return taken if (piece.doc, piece.piece) == (doc, index) else 0

    def add(self, piece: Piece, ids: np.ndarray, on_shard: Callable[[], None]) -> None:
        """The piece's ids (those a resume has not written already), flushing each shard as it fills."""
        drop = self.skips(piece)
        if drop is None:
            return
        ids, taken = ids[drop:], drop
        while len(ids):
            room = self.size - self.held
            part, ids = ids[:room], ids[room:]
            self.chunks.append(part)
            self.held += len(part)
            taken += len(part)
            done = not len(ids)
            self.documents += done and piece.last
            self.position = _after(piece) if done else (piece.doc, piece.piece, taken)
            if self.held == self.size:
                self.flush(on_shard)
        self.position = _after(piece)

    def flush(self, on_shard: Callable[[], None]) -> None:
        if not self.held:
            return
        name = shard_name(self.split, len(self.records))
        sha256, largest = write_tokens(self.out / name, self.chunks)
        self.records.append(ShardRecord(name, self.held, self.documents, sha256, largest, self.position))
        self.chunks, self.held, self.documents = [], 0, 0
        on_shard()


def _after(piece: Piece) -> tuple[int, int, int]:
    """The resume point just past a piece: the next piece of its document, or the next document."""
    return (piece.doc + 1, 0, 0) if piece.last else (piece.doc, piece.piece + 1, 0)


# -- the prepare ------------------------------------------------------------------------------------------------
def _open_output(out: Path, settings: PrepareSettings) -> Manifest | None:
    """The partial or complete manifest of the same prepare in ``out``, None for a new (empty) folder."""
    if out.exists() and not out.is_dir():
        raise DataError(f"prepare: output '{out}' exists and is not a folder")
    if not out.exists():
        out.mkdir(parents=True)
        return None
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest.settings != settings.identity():
            differ = sorted(k for k, v in settings.identity().items() if manifest.settings.get(k) != v)
            raise DataError(
                f"prepare: '{out}' holds another prepare (its {', '.join(differ)} differ); choose another --out "
                "or remove it"
            )
        return manifest
    # a prepare killed before its first manifest left its tokenizer at most: it is made again
    if any(p for p in out.iterdir() if not p.name.startswith(".") and p.name != TOKENIZER_DIR):
        raise DataError(f"prepare: output folder '{out}' is not empty and holds no {MANIFEST}; choose an empty one")
    return None


def _describe_source(source: Source, settings: PrepareSettings) -> dict[str, Any]:
    return {"dataset": source.location, "kind": source.kind, "text_field": source.text_field, "split": source.split,
            "hf_config": source.hf_config, "hf_data_files": source.hf_data_files,
            "suffixes": list(settings.suffixes) if source.kind == "folder" else None}  # fmt: skip


def _start(settings: PrepareSettings, out: Path, source: Source, console: Any) -> Manifest:
    manifest = _open_output(out, settings)
    if manifest is not None:
        return manifest
    plan = _plan_tokenizer(settings, source, out, console)
    # chosen once: a resume encodes with the engine the written shards came from
    engine = choose_engine(plan.type, plan.file, _pieces(source, settings, skip_unreadable=True))
    manifest = Manifest(dtype=dtype_for(plan.vocab_size), vocab_size=plan.vocab_size, eot_id=plan.eot_id,
                        tokenizer={**plan.describe(), "encoder": engine}, source=_describe_source(source, settings),
                        settings=settings.identity())  # fmt: skip
    write_manifest(out, manifest)
    return manifest


def _batches(
    pieces: Iterator[Piece], writers: dict[str, ShardWriter], skipped: Callable[[int], None]
) -> Iterator[list[Piece]]:
    """Pieces grouped into batches of about BATCH_BYTES, leaving out those a resume has written already (their
    size goes to ``skipped``)."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        if writers[piece.split].skips(piece) is None:
            skipped(len(piece.text))
            continue
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(batches: Iterator[list[Piece]], encoder_args: tuple, processes: int) -> Iterator[list[tuple]]:
    """Each batch encoded, in order; with several processes, a bounded number of batches in flight."""
    if processes == 1:
        encoder = _Encoder(*encoder_args)
        for batch in batches:
            yield encoder.encode(batch)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # no threads of this process (BPE training) are inherited
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_start_encoder, initargs=encoder_args) as pool:
        flight: deque[Future] = deque()
        for batch in batches:
            flight.append(pool.submit(_encode_in_process, batch))
            if len(flight) >= 3 * processes:
                yield flight.popleft().result()
        while flight:
            yield flight.popleft().result()


def prepare(settings: PrepareSettings, out: Path, console: Any) -> Manifest:
    """Tokenize ``settings.source`` into ``out`` (resuming a prepare of the same settings there)."""
    settings.check()
    if Path(settings.source).exists():  # a path, however it is spelled, names the same prepare
        settings = replace(settings, source=str(Path(settings.source).resolve()))
        if out.resolve().is_relative_to(settings.source):
            raise DataError(f"prepare: --out '{out}' lies inside the source '{settings.source}', which it would read")
    source = resolve_source(settings.source, text_field=settings.text_field, hf_config=settings.hf_config,
                            split=settings.split, hf_data_files=settings.hf_data_files,
                            suffixes=settings.suffixes)  # fmt: skip
    try:
        manifest = _start(settings, out, source, console)
        if manifest.complete:
            _say(console, f"'{out}' is prepared already")
            return manifest
        return _write(settings, out, source, manifest, console)
    except BrokenProcessPool as error:
        raise RuntimeError(f"a tokenizing process died ({first_line(error)})") from None
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"prepare: the disk is full writing '{out}'; free space and run the same command to "
                            "resume (the shards written stay)") from None  # fmt: skip
        raise DataError(f"prepare: {error.strerror or first_line(error)}: '{error.filename}'") from None


def _write(settings: PrepareSettings, out: Path, source: Source, manifest: Manifest, console: Any) -> Manifest:
    writers = {split: ShardWriter(out, split, settings.shard_tokens, records)
               for split, records in (("train", manifest.train), ("val", manifest.val))}  # fmt: skip
    skipped: list[str] = []
    started = time.perf_counter()
    totals = {"bytes": 0, "tokens": 0, "resumed_past": 0}
    tokenizer = manifest.tokenizer
    file = str(out / TOKENIZER_DIR / "tokenizer.json") if tokenizer["dir"] else None
    engine = tokenizer.get("encoder") or choose_engine(tokenizer["type"], file, _pieces(source, settings, True))
    encoder_args = (engine, file, manifest.eot_id, manifest.dtype)
    pieces = _pieces(source, settings, skipped=skipped)
    cpu_before = _cpu_seconds()
    with PrepareProgress(console, source_size(source, settings)) as progress:

        def resumed_past(size: int) -> None:
            totals["resumed_past"] += size

        for results in _encoded(_batches(pieces, writers, resumed_past), encoder_args, settings.processes):
            for piece, ids, size in results:
                writers[piece.split].add(piece, ids, lambda: write_manifest(out, manifest))
                totals["bytes"] += size
                totals["tokens"] += len(ids)
            progress.update(totals["bytes"], totals["tokens"], totals["resumed_past"])
    for writer in writers.values():
        writer.flush(lambda: write_manifest(out, manifest))
    if not manifest.train:
        raise DataError(f"prepare: source '{settings.source}' gave no training tokens (every document held out?)")
    if not manifest.val:
        raise DataError(f"prepare: source '{settings.source}' gave no validation tokens")
    seconds = time.perf_counter() - started
    busy = round((_cpu_seconds() - cpu_before) / max(seconds, 1e-9), 2)  # the tokenizing processes included, once ended
    manifest.stats = {**_stats(manifest, totals, seconds, skipped, settings.processes), "cores_busy": busy}
    manifest.complete = True
    write_manifest(out, manifest)
    return manifest


def _cpu_seconds() -> float:
    """CPU time of this process and of its ended children (the tokenizing processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _stats(manifest: Manifest, totals: dict[str, int], seconds: float, skipped: list[str], processes: int) -> dict:
    tokens = sum(r.tokens for r in [*manifest.train, *manifest.val])
    return {
        "seconds": round(seconds, 3),
        "processes": processes,
        "text_bytes_this_run": totals["bytes"],
        "tokens_this_run": totals["tokens"],
        "mb_per_s": round(totals["bytes"] / 1e6 / max(seconds, 1e-9), 3),
        "tokens_per_s": round(totals["tokens"] / max(seconds, 1e-9)),
        "bytes_per_token": round(totals["bytes"] / max(totals["tokens"], 1), 4),
        "tokens": tokens,
        "skipped_files": len(skipped),
        "skipped_examples": skipped[:5],
    }


def summary(manifest: Manifest, out: Path) -> str:
    """What a prepare wrote, in three lines."""

    def split(records: list[ShardRecord]) -> str:
        tokens, documents = sum(r.tokens for r in records), sum(r.documents for r in records)
        return f"{len(records)} shard{'s' * (len(records) != 1)}, {tokens:,} tokens, {documents:,} documents"

    stats = manifest.stats
    tokenizer = manifest.tokenizer
    lines = [
        f"prepared {out}: training {split(manifest.train)}; validation {split(manifest.val)}",
        f"tokenizer {tokenizer['type']} ({tokenizer['origin']}), vocabulary {manifest.vocab_size:,}, "
        f"{manifest.dtype}, end of document id {manifest.eot_id}",
    ]
    if stats:
        lines.append(
            f"{stats['text_bytes_this_run'] / 1e6:,.1f} MB of text in {stats['seconds']:,.1f} s "
            f"({stats['mb_per_s']:,.2f} MB/s, {stats['tokens_per_s']:,} tokens/s, {stats['processes']} processes), "
            f"{stats['bytes_per_token']:.2f} bytes per token"
            + (f"; {stats['skipped_files']:,} unreadable files skipped" if stats["skipped_files"] else "")
        )
    return "\n".join(lines)
