"""Small corpora written on the fly for the data tests."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
WORDS += ["quietly", "hex", "bold", "jackals"]


def document(index: int, words: int = 30) -> str:
    """A deterministic document; its index is written into it so shares can be told apart."""
    body = " ".join(WORDS[(index * 7 + k * 3) % len(WORDS)] for k in range(words))
    return f"doc{index}: {body}."


def write_jsonl(path: Path, count: int, field: str = "text", words: int = 30) -> list[str]:
    texts = [document(i, words) for i in range(count)]
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return texts


def write_parquet(path: Path, count: int, row_group_size: int = 16, field: str = "text") -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [document(i) for i in range(count)]
    pq.write_table(pa.table({field: texts, "id": list(range(count))}), path, row_group_size=row_group_size)
    return texts
