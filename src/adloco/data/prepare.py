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
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from adloco.data.documents import Piece, PrepareSettings, pieces, source_size
from adloco.data.encoding import choose_engine, encode_batches
from adloco.data.prepare_progress import PrepareProgress
from adloco.data.sources import (
    Source,
    first_line,
    resolve_source,
)
from adloco.data.token_files import (
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

BATCH_BYTES = 1 << 20  # text per batch sent to a tokenizing process
BYTE_EOT = 0  # the byte tokenizer's end of document: NUL, which no text source holds (they are refused)


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
    for piece in pieces(source, settings, skip_unreadable=True):
        if piece.split != "train":
            continue
        if index % settings.bpe_every == 0:
            text = piece.text[: settings.bpe_chars - used]
            yield text
            used += len(text)
            if used >= settings.bpe_chars:
                return
        index += 1


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
    engine = choose_engine(plan.type, plan.file, pieces(source, settings, skip_unreadable=True))
    manifest = Manifest(dtype=dtype_for(plan.vocab_size), vocab_size=plan.vocab_size, eot_id=plan.eot_id,
                        tokenizer={**plan.describe(), "encoder": engine}, source=_describe_source(source, settings),
                        settings=settings.identity())  # fmt: skip
    write_manifest(out, manifest)
    return manifest


def _batches(
    reading: Iterator[Piece], writers: dict[str, ShardWriter], skipped: Callable[[int], None]
) -> Iterator[list[Piece]]:
    """Pieces grouped into batches of about BATCH_BYTES, leaving out those a resume has written already (their
    size goes to ``skipped``)."""
    batch: list[Piece] = []
    size = 0
    for piece in reading:
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
    engine = tokenizer.get("encoder") or choose_engine(tokenizer["type"], file, pieces(source, settings, True))
    encoder_args = (engine, file, manifest.eot_id, manifest.dtype)
    reading = pieces(source, settings, skipped=skipped)
    cpu_before = _cpu_seconds()
    with PrepareProgress(console, source_size(source, settings)) as progress:

        def resumed_past(size: int) -> None:
            totals["resumed_past"] += size

        for results in encode_batches(_batches(reading, writers, resumed_past), encoder_args, settings.processes):
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
