"""Where text comes from: the bundled corpus, text files and folders, JSON Lines, Parquet and `datasets`.

Every source is read as a sequence of *documents* (strings). In memory the documents are joined with a
separator into one text; streaming reads them one at a time and never holds the whole corpus.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from adloco.config import HF_PREFIX
from adloco.data.hub import looks_local, not_found_offline, offline_message, offline_reason
from adloco.errors import DataError

if TYPE_CHECKING:
    from adloco.config import DataConfig

BUNDLED = {"tinyshakespeare": "tinyshakespeare.txt.gz"}
TEXT_SUFFIXES = (".txt", ".md")

SourceKind = Literal["bundled", "text", "folder", "jsonl", "parquet", "hf"]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def decode_text(raw: bytes, where: str) -> str:
    """UTF-8 text; binary (NUL bytes) or other encodings are a DataError naming ``where``."""
    if b"\x00" in raw:
        raise DataError(f"{where} looks binary (it contains NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{where} is not UTF-8 text (byte {error.start})") from None


def bundled_text(name: str) -> str:
    blob = resources.files(__package__).joinpath(BUNDLED[name]).read_bytes()
    return gzip.decompress(blob).decode("ascii")


def read_text_file(path: Path) -> str:
    """A whole UTF-8 text file; binary or non-UTF-8 content is a DataError."""
    return decode_text(path.read_bytes(), f"data file '{path}'")


def iter_text_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file, each with its line end, read lazily."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield decode_text(raw, f"data file '{path}' line {number}")


def folder_files(path: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The files with one of ``suffixes`` (default *.txt, *.md) under a folder, recursively, in sorted order
    (``*`` takes every file)."""
    every = "*" in suffixes
    wanted = {s.lower() for s in suffixes}
    files = sorted(
        Path(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if (every or os.path.splitext(name)[1].lower() in wanted) and os.path.isfile(os.path.join(root, name))
    )
    if not files:
        raise DataError(f"data folder '{path}' has no {' or '.join('*' + s for s in suffixes)} files")
    return files


def _field_of(row: Any, field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a JSON object")
    if field not in row:
        fields = ", ".join(map(str, list(row)[:8])) or "none"
        raise DataError(f"{where} has no field '{field}' (fields: {fields}); set data.text_field")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' is {type(value).__name__}, not text")
    return value


def iter_records(path: str | Path, format: Literal["jsonl", "parquet"], start: int = 0) -> Iterator[dict]:
    """The rows of a JSON Lines or Parquet file as dicts, read lazily, from row ``start`` on.

    Blank JSON Lines lines are not rows. Parquet is read one row group at a time, and whole row groups
    before ``start`` are skipped from the file's metadata without being read.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist")
    if format == "jsonl":
        index = 0
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                if index >= start:
                    line = decode_text(raw, f"data file '{path}' line {number}")
                    try:
                        row = json.loads(line)
                    except ValueError as error:
                        raise DataError(f"data file '{path}' line {number} is not valid JSON ({error.msg})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"data file '{path}' line {number} is not a JSON object")
                    yield row
                index += 1
        return
    if format == "parquet":
        yield from _parquet_rows(path, start)
        return
    raise DataError(f"unknown record format '{format}' (jsonl or parquet)")


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a damaged or foreign file
        raise DataError(f"data file '{path}' is not a valid Parquet file ({first_line(error)})") from None


def _parquet_rows(path: Path, start: int, columns: list[str] | None = None) -> Iterator[dict]:
    parquet = _parquet_file(path)
    offset = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if offset + rows <= start:
            offset += rows
            continue
        try:
            table = parquet.read_row_group(group, columns=columns)
        except Exception as error:
            raise DataError(f"data file '{path}' row group {group} cannot be read ({first_line(error)})") from None
        for index, row in enumerate(table.to_pylist()):
            if offset + index >= start:
                yield row
        offset += rows


@dataclass(frozen=True)
class Source:
    """One data source, resolved from ``data.dataset`` (and the ``data.hf_*`` keys)."""

    kind: SourceKind
    location: str
    text_field: str = "text"
    separator: str = "\n\n"
    hf_config: str | None = None
    split: str = "train"
    hf_data_files: str | None = None
    suffixes: tuple[str, ...] = TEXT_SUFFIXES  # a folder's files that are read

    @property
    def line_documents(self) -> bool:
        """Plain text is streamed line by line: each line (with its line end) is a document."""
        return self.kind in ("bundled", "text", "folder")

    def documents(self, start: int = 0, streaming: bool = False) -> Iterator[str]:
        """The documents in order, from document ``start`` on.

        Streaming plain text yields lines (a file ends with the separator, so files stay apart); otherwise
        a text file is one document and a folder one document per file.
        """
        if self.kind == "bundled":
            texts: Iterator[str] = iter([bundled_text(self.location)])
            if streaming:
                texts = (line for line in bundled_text(self.location).splitlines(keepends=True))
            yield from _skip(texts, start)
        elif self.kind == "text":
            path = Path(self.location)
            yield from _skip(iter_text_lines(path) if streaming else iter([read_text_file(path)]), start)
        elif self.kind == "folder":
            files = folder_files(Path(self.location), self.suffixes)
            if streaming:
                yield from _skip(self._folder_lines(files), start)
            else:
                yield from _skip((read_text_file(f) for f in files), start)
        elif self.kind in ("jsonl", "parquet"):
            for number, row in enumerate(iter_records(self.location, self.kind, start), start=start + 1):
                yield _field_of(row, self.text_field, f"data file '{self.location}' row {number}")
        else:
            yield from self._hf_documents(start, streaming)

    def _folder_lines(self, files: list[Path]) -> Iterator[str]:
        for path in files:
            previous = None
            for line in iter_text_lines(path):
                if previous is not None:
                    yield previous
                previous = line
            if previous is not None:
                yield previous + self.separator

    def _hf_documents(self, start: int, streaming: bool) -> Iterator[str]:
        dataset = self._hf_dataset(streaming)
        columns = getattr(dataset, "column_names", None)
        if columns is not None and self.text_field not in columns:
            raise DataError(
                f"dataset '{self.location}' has no field '{self.text_field}' (fields: {', '.join(columns)}); "
                "set data.text_field"
            )
        if start:
            dataset = dataset.skip(start)
        for number, row in enumerate(dataset, start=start + 1):
            yield _field_of(row, self.text_field, f"dataset '{self.location}' row {number}")

    def _hf_dataset(self, streaming: bool) -> Any:
        try:
            import datasets
        except ImportError:
            raise DataError("Hugging Face datasets need the 'datasets' package (pip install datasets)") from None
        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        local = Path(self.location)
        try:
            if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
                # A folder written by Dataset.save_to_disk: memory-mapped, so iterating it stays lazy.
                loaded = datasets.load_from_disk(str(local))
                if isinstance(loaded, datasets.DatasetDict):
                    if self.split not in loaded:
                        raise DataError(
                            f"dataset '{self.location}' has no split '{self.split}' (splits: {', '.join(loaded)})"
                        )
                    loaded = loaded[self.split]
                return loaded
            # datasets' own builders (json, csv, parquet, text...) read local files and need no Hub
            builder = self.location in datasets.packaged_modules._PACKAGED_DATASETS_MODULES
            reason = None if builder or looks_local(self.location) else offline_reason()
            try:
                return _load_dataset(self, streaming)
            except Exception as error:
                why = not_found_offline(error, reason)
                if why is not None:
                    raise DataError(offline_message("dataset", self.location, why)) from None
                raise
        except DataError:
            raise
        except Exception as error:  # datasets reports missing data, bad splits and network trouble many ways
            raise DataError(f"dataset '{self.location}' cannot be loaded: {first_line(error)}") from None

    def read_text(self) -> str:
        """All documents joined with the separator (the in-memory corpus)."""
        if self.kind in ("bundled", "text"):
            return next(self.documents())
        parts = list(self.documents())
        if not parts:
            raise DataError(f"data '{self.location}' has no rows")
        return self.separator.join(parts)


def _load_dataset(source: Source, streaming: bool) -> Any:
    import datasets

    return datasets.load_dataset(
        source.location, source.hf_config, split=source.split, data_files=source.hf_data_files, streaming=streaming
    )


def _skip(items: Iterator[str], start: int) -> Iterator[str]:
    for index, item in enumerate(items):
        if index >= start:
            yield item


def resolve_source(
    dataset: str,
    text_field: str = "text",
    separator: str = "\n\n",
    hf_name: str | None = None,
    hf_config: str | None = None,
    split: str = "train",
    hf_data_files: str | None = None,
    suffixes: tuple[str, ...] = TEXT_SUFFIXES,
) -> Source:
    """What ``dataset`` names: a bundled corpus, ``hf:NAME``, a folder, a .jsonl/.parquet file or a text file."""
    extra = {"text_field": text_field, "separator": separator}
    hf = {"hf_config": hf_config, "split": split, "hf_data_files": hf_data_files}
    if hf_name is not None or dataset.startswith(HF_PREFIX):
        name = hf_name if hf_name is not None else dataset[len(HF_PREFIX) :]
        if not name:
            raise DataError("data.dataset 'hf:' names no dataset (use hf:NAME)")
        return Source("hf", name, **extra, **hf)
    if dataset in BUNDLED:
        return Source("bundled", dataset, **extra)
    path = Path(dataset)
    if not path.exists():
        raise DataError(f"data file '{dataset}' does not exist (bundled datasets: {', '.join(BUNDLED)})")
    if path.is_dir():
        folder_files(path, suffixes)  # an empty folder is an error now, not at the first batch
        return Source("folder", dataset, **extra, suffixes=suffixes)
    if not path.is_file():
        raise DataError(f"data path '{dataset}' is not a file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return Source("jsonl", dataset, **extra)
    if suffix == ".parquet":
        _parquet_file(path)
        return Source("parquet", dataset, **extra)
    return Source("text", dataset, **extra)


def source_from_config(data: DataConfig) -> Source:
    """The Source a ``DataConfig`` names."""
    return resolve_source(
        data.dataset,
        text_field=data.text_field,
        separator=data.separator,
        hf_name=data.hf_name,
        hf_config=data.hf_config,
        split=data.split,
        hf_data_files=data.hf_data_files,
    )


def read_text(dataset: str) -> str:
    """The bundled corpus by name, or the text of a file, folder, JSON Lines or Parquet file by path."""
    return resolve_source(dataset).read_text()


def dataset_label(dataset: str) -> str:
    if dataset in BUNDLED:
        return dataset
    name = dataset[len(HF_PREFIX) :] if dataset.startswith(HF_PREFIX) else dataset
    name = Path(name.rstrip("/")).stem or "data"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
