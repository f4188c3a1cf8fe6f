"""The data a run names, checked before torch and transformers are imported: existence, type, emptiness and format
of the source, and (where the token count is known without tokenizing: token files, bytes) whether the splits
hold a context. The full checks still run when the corpus loads; these say the common mistakes in a second."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from adloco.data.sources import BUNDLED, HF_PREFIX, decode_text, source_from_config
from adloco.data.token_files import names_token_files, open_token_source
from adloco.errors import DataError

if TYPE_CHECKING:
    from adloco.config import DataConfig

HEAD_BYTES = 1 << 16  # how much of a text file is read to see that it is text


def check_data(data: DataConfig, context: int | None) -> None:
    """DataError for a language-modelling source that cannot train at ``context`` (None: not known yet)."""
    if data.dataset.startswith(HF_PREFIX) or data.hf_name is not None:
        return  # the datasets library and perhaps the Hub answer for these, when the corpus loads
    if names_token_files(data.dataset):
        _check_token_files(data, context)
        return
    source = source_from_config(data)  # exists, is a file or a folder of text files, a readable Parquet file
    if source.kind in ("jsonl", "parquet"):
        if next(source.documents(streaming=True), None) is None:
            raise DataError(f"data file '{source.location}' has no rows")
        return
    if source.kind == "bundled" or data.dataset in BUNDLED:
        return
    files = [Path(source.location)] if source.kind == "text" else _folder_files(source)
    sizes = [f.stat().st_size for f in files]
    if not any(sizes):
        raise DataError(f"data '{source.location}' is empty")
    for path in files[:8]:
        _check_text_head(path)
    if data.tokenizer == "byte" and not data.streaming and context is not None:
        # in memory at byte level a token is a byte: the same split as the corpus will make, known from the sizes
        total = sum(sizes) + len(data.separator.encode()) * (len(files) - 1)
        train = int(total * (1 - data.val_fraction))
        for name, tokens in (("training", train), ("validation", total - train)):
            if tokens < context + 1:
                raise DataError(
                    f"data '{source.location}': the {name} split has {tokens} tokens, fewer than one context of "
                    f"{context} plus one"
                )


def _folder_files(source: object) -> list[Path]:
    from adloco.data.sources import folder_files

    return folder_files(Path(source.location), source.suffixes)  # type: ignore[attr-defined]


def _check_text_head(path: Path) -> None:
    """The first HEAD_BYTES of a text file decode as UTF-8 without NUL (a character cut at the end is no error)."""
    with path.open("rb") as handle:
        head = handle.read(HEAD_BYTES)
    for cut in range(4):  # at most three bytes of a character lie past the cut
        try:
            decode_text(head[: len(head) - cut] if cut else head, f"data file '{path}'")
            return
        except DataError as error:
            if cut == 3 or "not UTF-8" not in str(error) or len(head) < HEAD_BYTES:
                raise


def _check_token_files(data: DataConfig, context: int | None) -> None:
    source = open_token_source(data.dataset, data.val_dataset, data.val_fraction, verify=False)
    if context is None:
        return
    for name, part in (("training", source.train), ("validation", source.val)):
        tokens = 0 if part is None else len(part)
        if tokens < context + 1:
            raise DataError(
                f"data '{source.where}': the {name} split has {tokens} tokens, fewer than one context of {context} "
                "plus one"
            )
