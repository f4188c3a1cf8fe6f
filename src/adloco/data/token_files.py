"""Token files: a folder ``adloco prepare`` wrote (its ``manifest.json``), nanoGPT's raw uint16 ``.bin``, llm.c's
``.bin`` shards (a header of 256 int32) and ``.npy`` arrays, read a window at a time, never loaded whole.

This module owns the prepared folder's format: the manifest's fields, the shard names and their checks. Pages of
the files live in the operating system's page cache, so every rank of a machine that reads the same
files shares them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adloco.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "adloco-tokens"
FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# llm.c: a header of 256 little-endian int32, [0] magic, [1] version, [2] tokens; the magic says the token width
LLMC_HEADER_INTS = 256
LLMC_FORMATS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
TOKEN_SUFFIXES = (".bin", ".npy")
OPEN_FILES = 64  # token files a reader keeps open at once
_READ_CHUNK = 1 << 24  # bytes per read when scanning or hashing: large enough to be fast, small enough for RSS


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks (not mapped: hashing a corpus must not grow the process)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenFile:
    """One file of tokens: ``tokens`` ids of ``dtype`` starting ``offset`` bytes into ``path``."""

    path: Path
    dtype: np.dtype
    tokens: int
    offset: int = 0

    def max_id(self) -> int:
        """The largest id in the file, read in chunks (-1 when empty)."""
        largest = -1
        width = self.dtype.itemsize
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            left = self.tokens
            while left:
                count = min(left, _READ_CHUNK // width)
                chunk = np.frombuffer(handle.read(count * width), dtype=self.dtype)
                if len(chunk) < count:
                    raise DataError(f"token file '{self.path}' ended early (truncated?)")
                largest = max(largest, int(chunk.max()))
                left -= count
        return largest


class TokenArray:
    """Token files read as one sequence of ids (windows may span two files).

    Windows are read with ``pread``, not through a memory map: on kernels that keep large folios in the page cache
    (Linux 6.x with ext4), touching one token of a mapped file maps its whole 2 MB folio into the process, so a run
    sampling windows at random would count most of a corpus in its resident memory (+1 GB over a 4 GB folder in
    a 40k-token run, docs/data.md). A read copies just the window; the pages stay in the operating system's cache,
    shared by every process of the machine that reads the same files, as a mapping's would.
    """

    def __init__(self, files: Sequence[TokenFile]) -> None:
        self.files = list(files)
        self._open: OrderedDict[int, int] = OrderedDict()  # file index -> descriptor, the least recent first
        self.starts = np.cumsum([0] + [f.tokens for f in self.files], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader's worker process opens the files anew
        return {**self.__dict__, "_open": OrderedDict()}

    def __del__(self) -> None:
        for fd in getattr(self, "_open", {}).values():
            os.close(fd)

    def _descriptor(self, index: int) -> int:
        """File ``index`` opened, keeping at most OPEN_FILES open (a corpus of thousands of shards stays under the
        process's limit on open files)."""
        fd = self._open.pop(index, None)
        if fd is None:
            if len(self._open) >= OPEN_FILES:
                os.close(self._open.popitem(last=False)[1])
            fd = os.open(self.files[index].path, os.O_RDONLY)
        self._open[index] = fd
        return fd

    def windows(self, context: int) -> int:
        """Windows of ``context + 1`` tokens starting at multiples of ``context``."""
        return max(0, (len(self) - 1) // context)

    def _read(self, index: int, start: int, count: int) -> np.ndarray:
        """``count`` tokens (fewer at the file's end) from token ``start`` of file ``index``."""
        f = self.files[index]
        count = min(count, f.tokens - start)
        width = f.dtype.itemsize
        raw = os.pread(self._descriptor(index), count * width, f.offset + start * width)
        if len(raw) != count * width:
            raise DataError(f"token file '{f.path}' ended early (truncated while training?)")
        return np.frombuffer(raw, dtype=f.dtype)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of ``length`` tokens starting at each of ``starts``, as int64 (rows × length)."""
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"a window of {length} tokens from {int(starts.max())} lies outside the {len(self):,}")
        out = np.empty((len(starts), length), dtype=np.int64)
        which = np.searchsorted(self.starts, starts, side="right") - 1
        for row, (start, index) in enumerate(zip(starts.tolist(), which.tolist(), strict=True)):
            filled, local = 0, start - int(self.starts[index])
            while filled < length:  # a window may run on into the next file(s)
                piece = self._read(index, local, length - filled)
                out[row, filled : filled + len(piece)] = piece
                filled, index, local = filled + len(piece), index + 1, 0
        return out

    def part(self, start: int, stop: int) -> TokenArray:
        """Tokens [start, stop) of the sequence, as a TokenArray over the same files."""
        files = []
        for f, begin in zip(self.files, self.starts[:-1].tolist(), strict=True):
            lo, hi = max(start, begin), min(stop, begin + f.tokens)
            if lo < hi:
                files.append(TokenFile(f.path, f.dtype, hi - lo, f.offset + (lo - begin) * f.dtype.itemsize))
        return TokenArray(files)

    def max_id(self) -> int:
        return max((f.max_id() for f in self.files), default=-1)


# -- the prepared folder's manifest -----------------------------------------------------------------------------
@dataclass
class ShardRecord:
    """A written shard: its file (relative to the folder), tokens, documents, checksum and largest id."""

    file: str
    tokens: int
    documents: int
    sha256: str
    max_id: int
    # where the shard's tokens end in the source: (document, piece of it, tokens of that piece written)
    ends_at: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardRecord:
        ends_at = tuple(int(v) for v in data["ends_at"])
        if len(ends_at) != 3:
            raise ValueError(f"ends_at holds {len(ends_at)} numbers, not 3")
        return cls(str(data["file"]), int(data["tokens"]), int(data["documents"]), str(data["sha256"]),
                   int(data["max_id"]), ends_at)  # type: ignore[arg-type]  # fmt: skip


@dataclass
class Manifest:
    """What a prepared folder holds: ``train`` and ``val`` shards, their dtype, the tokenizer and the source."""

    dtype: str
    vocab_size: int
    eot_id: int
    tokenizer: dict[str, Any]
    source: dict[str, Any]
    settings: dict[str, Any]
    train: list[ShardRecord] = field(default_factory=list)
    val: list[ShardRecord] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    complete: bool = False

    def to_json(self) -> dict[str, Any]:
        def split(records: list[ShardRecord]) -> dict[str, Any]:
            return {
                "tokens": sum(r.tokens for r in records),
                "documents": sum(r.documents for r in records),
                "shards": [{**r.__dict__, "ends_at": list(r.ends_at)} for r in records],
            }

        return {"format": FORMAT, "version": FORMAT_VERSION, "complete": self.complete, "dtype": self.dtype,
                "vocab_size": self.vocab_size, "eot_id": self.eot_id, "tokenizer": self.tokenizer,
                "source": self.source, "settings": self.settings, "stats": self.stats,
                "train": split(self.train), "val": split(self.val)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DataError(f'\'{where}\' is not an adloco token manifest (no "format": "{FORMAT}")')
        if data.get("version") != FORMAT_VERSION:
            raise DataError(
                f"'{where}' has token format version {data.get('version')!r}; this adloco reads {FORMAT_VERSION}"
            )
        if data.get("dtype") not in DTYPES:
            raise DataError(f"'{where}' names dtype {data.get('dtype')!r}; token files are {' or '.join(DTYPES)}")
        try:
            return cls(
                dtype=data["dtype"], vocab_size=int(data["vocab_size"]), eot_id=int(data["eot_id"]),
                tokenizer=dict(data["tokenizer"]), source=dict(data["source"]), settings=dict(data["settings"]),
                train=[ShardRecord.from_json(s) for s in data["train"]["shards"]],
                val=[ShardRecord.from_json(s) for s in data["val"]["shards"]],
                stats=dict(data.get("stats", {})), complete=bool(data.get("complete", False)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"'{where}' is a damaged token manifest ({type(error).__name__}: {error})") from None


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"token folder '{folder}' has no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"'{path}' cannot be read as JSON ({error})") from None
    return Manifest.from_json(data, str(path))


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """The manifest, written whole or not at all (a temporary file renamed over it)."""
    staging = folder / f".{MANIFEST}.tmp"
    staging.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    os.replace(staging, folder / MANIFEST)


def tokenizer_digest(folder: Path) -> str | None:
    """A fingerprint of a saved Hugging Face tokenizer (its tokenizer.json), None when there is none."""
    path = folder / "tokenizer.json"
    return file_sha256(path) if path.is_file() else None


def check_shard(folder: Path, record: ShardRecord, dtype: str, verify: bool) -> TokenFile:
    """The shard as a TokenFile after checking its size (and with ``verify`` its sha256) against the manifest."""
    path = folder / record.file
    width = DTYPES[dtype].itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"token folder '{folder}': shard '{record.file}' is missing") from None
    if size != record.tokens * width:
        raise DataError(
            f"token folder '{folder}': shard '{record.file}' has {size:,} bytes, the manifest says "
            f"{record.tokens * width:,} (truncated or replaced)"
        )
    if verify and file_sha256(path) != record.sha256:
        raise DataError(f"token folder '{folder}': shard '{record.file}' does not match its sha256 (altered)")
    return TokenFile(path, DTYPES[dtype], record.tokens)


# -- what data.dataset names ------------------------------------------------------------------------------------
@dataclass
class TokenSource:
    """Training and validation tokens of a token-file dataset, and what is known of their vocabulary."""

    train: TokenArray
    val: TokenArray | None
    where: str
    largest_id: int | None = None  # known without a scan (a manifest), else None

    def max_id(self) -> int:
        if self.largest_id is None:
            parts = [self.train] + ([self.val] if self.val is not None else [])
            self.largest_id = max(p.max_id() for p in parts)
        return self.largest_id


def is_glob(name: str) -> bool:
    return any(c in name for c in "*?[")


def names_token_files(dataset: str) -> bool:
    """Whether ``data.dataset`` names token files (a prepared folder, .bin/.npy files or a glob of them)."""
    if dataset.startswith("hf:"):
        return False
    path = Path(dataset)
    if path.is_dir():
        return (path / MANIFEST).is_file() or _holds_token_files(path)
    if is_glob(dataset):
        return any(Path(p).suffix.lower() in TOKEN_SUFFIXES for p in glob.glob(dataset))
    return path.suffix.lower() in TOKEN_SUFFIXES


def _holds_token_files(path: Path) -> bool:
    """Token files and no text files: a folder of shards, not a text corpus with a stray .bin."""
    suffixes = {p.suffix.lower() for p in path.iterdir() if p.is_file()}
    return bool(suffixes & set(TOKEN_SUFFIXES)) and not suffixes & {".txt", ".md"}


def prepared_folder(dataset: str) -> Path | None:
    """The folder when ``data.dataset`` names a prepared one (it has a manifest), else None."""
    if dataset.startswith("hf:"):
        return None
    path = Path(dataset)
    return path if path.is_dir() and (path / MANIFEST).is_file() else None


def open_prepared(folder: Path, verify: bool = True) -> TokenSource:
    """A prepared folder: its manifest read, every shard checked (size, with ``verify`` the sha256 too)."""
    manifest = read_manifest(folder)
    if not manifest.complete:
        raise DataError(f"token folder '{folder}' is not finished; run adloco prepare again to complete it")
    if not manifest.train:
        raise DataError(f"token folder '{folder}' has no training shards")
    train = TokenArray([check_shard(folder, r, manifest.dtype, verify) for r in manifest.train])
    val = TokenArray([check_shard(folder, r, manifest.dtype, verify) for r in manifest.val])
    largest = max(r.max_id for r in [*manifest.train, *manifest.val])
    return TokenSource(train, val if len(val) else None, str(folder), largest)


def _token_file(path: Path) -> TokenFile:
    """One .bin (llm.c header, else raw uint16 as nanoGPT writes) or .npy file."""
    if not path.is_file():
        raise DataError(f"token file '{path}' does not exist")
    size = path.stat().st_size
    if path.suffix.lower() == ".npy":
        return _npy_file(path)
    with path.open("rb") as handle:
        head = handle.read(LLMC_HEADER_INTS * 4)
    magic = int(np.frombuffer(head[:4], dtype="<i4")[0]) if len(head) >= 4 else None
    if magic in LLMC_FORMATS:
        if len(head) < LLMC_HEADER_INTS * 4:
            raise DataError(f"token file '{path}' has an llm.c magic number but a header of only {len(head)} bytes")
        header = np.frombuffer(head, dtype="<i4")
        version, dtype = LLMC_FORMATS[magic]
        if int(header[1]) != version:
            raise DataError(
                f"token file '{path}' has an unknown llm.c header (magic {magic}, version {int(header[1])}; "
                f"known: version {version})"
            )
        tokens = int(header[2])
        if size != len(head) + tokens * dtype.itemsize:
            raise DataError(
                f"token file '{path}': its llm.c header says {tokens:,} tokens, the file holds "
                f"{(size - len(head)) / dtype.itemsize:,.1f} (truncated?)"
            )
        return TokenFile(path, dtype, tokens, len(head))
    if _looks_like_a_header(head, size):
        header = np.frombuffer(head, dtype="<i4")
        raise DataError(
            f"token file '{path}' starts with an unknown header (magic {int(header[0])}, version {int(header[1])}; "
            f"known: llm.c's {', '.join(map(str, LLMC_FORMATS))})"
        )
    if size % 2:
        raise DataError(f"token file '{path}' has an odd number of bytes ({size:,}): not uint16 tokens")
    return TokenFile(path, DTYPES["uint16"], size // 2)


def _looks_like_a_header(head: bytes, size: int) -> bool:
    """A header of llm.c's layout under another magic: a date-like magic, a small version and a token count that
    fits the file, things raw uint16 tokens do not line up to by chance."""
    if len(head) < LLMC_HEADER_INTS * 4:
        return False
    magic, version, tokens = (int(v) for v in np.frombuffer(head[:12], dtype="<i4"))
    fits = any(size == len(head) + tokens * width for width in (2, 4))
    return 20_000_101 <= magic <= 21_001_231 and 0 < version < 1000 and tokens > 0 and fits


def _npy_file(path: Path) -> TokenFile:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise DataError(f"token file '{path}' is not a readable .npy array ({error})") from None
    if array.ndim != 1 or array.dtype.kind not in "ui" or not isinstance(array, np.memmap):
        raise DataError(f"token file '{path}' must hold a 1-D integer array, not {array.dtype} of shape {array.shape}")
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == "=" else array.dtype
    return TokenFile(path, np.dtype(dtype), int(array.shape[0]), int(array.offset))


def _expand(name: str) -> list[Path]:
    """The token files a name gives: a file, or a glob of them (in sorted order)."""
    path = Path(name)
    if path.is_dir():
        raise DataError(
            f"token folder '{name}' has no {MANIFEST}: prepare it with adloco prepare, or name its training files "
            f"with a glob (data.dataset='{name.rstrip('/')}/*train*.bin')"
        )
    files = sorted(Path(p) for p in glob.glob(name)) if is_glob(name) else [path]
    if not files:
        raise DataError(f"data '{name}' matches no token files")
    return files


def open_token_files(name: str) -> TokenArray:
    files = [_token_file(p) for p in _expand(name)]
    if len({f.dtype for f in files}) > 1:
        raise DataError(f"data '{name}': its files hold tokens of different widths")
    return TokenArray(files)


def open_token_source(dataset: str, val_dataset: str | None, val_fraction: float, verify: bool) -> TokenSource:
    """What ``data.dataset`` names: a prepared folder (validation from its manifest), else .bin/.npy files whose
    validation is ``val_dataset`` or the trailing ``val_fraction`` of their tokens."""
    folder = prepared_folder(dataset)
    if folder is not None:
        if val_dataset is not None:
            raise DataError(f"data.val_dataset: the prepared folder '{dataset}' holds its own validation split")
        return open_prepared(folder, verify)
    train = open_token_files(dataset)
    if val_dataset is not None:
        return TokenSource(train, open_token_files(val_dataset), dataset)
    cut = int(len(train) * (1 - val_fraction))
    return TokenSource(train.part(0, cut), train.part(cut, len(train)), dataset)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def write_tokens(path: Path, chunks: Iterable[np.ndarray]) -> tuple[str, int]:
    """Chunks of tokens into a new file, staged and renamed (a killed writer leaves no torn shard); its sha256 and
    the largest id written."""
    staging = path.with_name(f".{path.name}.tmp")
    digest, largest = hashlib.sha256(), -1
    try:
        with staging.open("wb") as handle:
            for chunk in chunks:
                raw = chunk.tobytes()
                digest.update(raw)
                handle.write(raw)
                if len(chunk):
                    largest = max(largest, int(chunk.max()))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return digest.hexdigest(), largest


def run_tokenizer(folder: Path, asked: str | None) -> str:
    """The ``data.tokenizer`` a run on a prepared folder uses: the folder's own (``byte``, or its ``tokenizer/``
    folder); a tokenizer named in the config must be that one."""
    manifest = read_manifest(folder)
    kind = manifest.tokenizer.get("type")
    own = "byte" if kind == "byte" else str(folder / TOKENIZER_DIR)
    if asked is None or asked == own or asked == manifest.tokenizer.get("origin") and kind != "bpe":
        return own
    if (
        kind != "byte"
        and asked != "bpe"
        and Path(asked).is_dir()
        and tokenizer_digest(Path(asked)) == (manifest.tokenizer.get("sha256"))
    ):
        return own
    prepared = f"'{folder}' was prepared with the tokenizer {manifest.tokenizer.get('origin')!r} ({kind})"
    raise DataError(f"data.tokenizer {asked!r} is not the one {prepared}; leave data.tokenizer unset to use it")


def check_resumed_tokenizer(dataset: str, saved: Path) -> None:
    """A resumed run on a prepared folder must find the tokenizer it started with there (not a re-prepare)."""
    folder = prepared_folder(dataset)
    if folder is None:
        return
    manifest = read_manifest(folder)
    if manifest.tokenizer.get("type") != "byte" and tokenizer_digest(saved) != manifest.tokenizer.get("sha256"):
        raise DataError(
            f"the token folder '{folder}' was prepared with another tokenizer than the one this run started with "
            f"('{saved}'); resume on the files it started on"
        )
