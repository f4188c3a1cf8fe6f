"""Labelled texts for sequence classification: JSON Lines, CSV/TSV or Parquet rows with a text and a label.

Labels may be integers or strings; the sorted distinct labels get ids 0, 1, … (integers sort numerically).
Texts are tokenized once, truncated or padded to the context, with an attention mask that hides the padding.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adloco.data.sources import DataError, iter_records
from adloco.data.tokenization import Tokenizer

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_INTEGER = re.compile(r"^\s*-?\d+\s*$")


@dataclass
class LabelledRows:
    """Texts and their raw labels, in file order."""

    texts: list[str]
    labels: list[Any]
    where: str

    def __len__(self) -> int:
        return len(self.texts)


def _csv_rows(path: Path) -> Iterator[dict]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            yield from csv.DictReader(handle, delimiter=delimiter)
    except UnicodeDecodeError as error:
        raise DataError(f"data file '{path}' is not UTF-8 text (byte {error.start})") from None
    except csv.Error as error:
        raise DataError(f"data file '{path}' is not valid CSV ({error})") from None


def _rows(path: Path) -> Iterator[dict]:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return iter_records(path, "jsonl")
    if suffix in (".csv", ".tsv"):
        return _csv_rows(path)
    if suffix == ".parquet":
        return iter_records(path, "parquet")
    raise DataError(f"labelled data file '{path}' must be .jsonl, .csv, .tsv or .parquet")


def read_labelled(dataset: str, text_field: str, label_field: str) -> LabelledRows:
    """Every row of a labelled file; a missing field, an empty text or an unusable label is a DataError."""
    path = Path(dataset)
    if not path.exists():
        raise DataError(f"labelled data file '{dataset}' does not exist")
    if not path.is_file():
        raise DataError(f"labelled data path '{dataset}' is not a file")
    texts: list[str] = []
    labels: list[Any] = []
    for number, row in enumerate(_rows(path), start=1):
        where = f"data file '{dataset}' row {number}"
        for field, key in ((text_field, "data.text_field"), (label_field, "data.label_field")):
            if field not in row:
                fields = ", ".join(map(str, list(row)[:8])) or "none"
                raise DataError(f"{where} has no field '{field}' (fields: {fields}); set {key}")
        text, label = row[text_field], row[label_field]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: field '{text_field}' must be a non-empty text")
        if isinstance(label, bool) or not isinstance(label, (int, str)) or label == "":
            raise DataError(f"{where}: label {label!r} is not an integer or a non-empty string")
        # NUL is the byte tokenizer's padding id; a model must never mistake text for padding.
        texts.append(text.replace("\x00", ""))
        labels.append(label)
    if not texts:
        raise DataError(f"labelled data file '{dataset}' has no rows")
    return LabelledRows(texts, labels, dataset)


def label_names(*parts: LabelledRows) -> list[str]:
    """The sorted distinct labels of all parts, as names; integers (also as CSV text) sort numerically."""
    values = [label for part in parts for label in part.labels]
    if all(isinstance(v, int) or _INTEGER.match(v) for v in values):
        names = [str(v) for v in sorted({int(v) for v in values})]
    else:
        names = sorted({str(v) for v in values})
    if len(names) < 2:
        raise DataError(f"labelled data '{parts[0].where}' has only one label ({names[0]}); classification needs two")
    return names


def _label_id(value: Any, ids: dict[str, int]) -> int:
    key = str(value)
    if key not in ids and (isinstance(value, int) or _INTEGER.match(value)):
        key = str(int(value))  # " 01" in a CSV is the label 1
    return ids[key]


@dataclass
class LabelledSplit:
    """Encoded rows: token ids and attention mask (rows × context) and label ids."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.numel())

    @classmethod
    def encode(
        cls, rows: LabelledRows, tokenizer: Tokenizer, context: int, pad_id: int, names: list[str]
    ) -> LabelledSplit:
        """Tokenize, keep the first ``context`` tokens, pad with ``pad_id`` (masked out)."""
        ids = {name: i for i, name in enumerate(names)}
        input_ids = torch.full((len(rows), context), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), context), dtype=torch.long)
        for row, text in enumerate(rows.texts):
            tokens = tokenizer.encode(text)[:context]
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        labels = torch.tensor([_label_id(v, ids) for v in rows.labels], dtype=torch.long)
        return cls(input_ids, mask, labels)

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids[rows], self.attention_mask[rows], self.labels[rows]


def split_rows(rows: LabelledRows, val_fraction: float) -> tuple[LabelledRows, LabelledRows]:
    """The leading rows for training and the trailing ``val_fraction`` for validation (both non-empty)."""
    split = int(len(rows) * (1 - val_fraction))
    if split < 1 or split >= len(rows):
        raise DataError(
            f"labelled data '{rows.where}' has {len(rows)} rows: too few to hold out data.val_fraction={val_fraction}"
        )
    return (
        LabelledRows(rows.texts[:split], rows.labels[:split], rows.where),
        LabelledRows(rows.texts[split:], rows.labels[split:], rows.where),
    )


class SampleStream:
    """One worker's endless, deterministic stream of labelled rows, drawn uniformly with replacement.

    As for token windows, the generator state is the whole cursor: saving and restoring it resumes exactly.
    """

    def __init__(self, split: LabelledSplit, seed: int) -> None:
        self.split = split
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, attention mask and label ids of ``size`` rows."""
        rows = torch.randint(0, len(self.split), (size,), generator=self.generator)
        return self.split.batch(rows)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
