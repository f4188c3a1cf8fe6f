"""Corpora, tokenizers, token files and deterministic, resumable per-worker streams.

Sources (``sources``): the bundled corpus, text files and folders, JSON Lines, Parquet and Hugging Face
``datasets``. Tokenizers (``tokenization``): bytes, a trained byte-level BPE, any Hugging Face tokenizer.
Token files (``token_files``, written by ``prepare``): shards read a window at a time, sampled by ``sampling``.
Streams (``streams``): random windows over an in-memory split, or packed windows read lazily.

Names are imported on first use, so that ``adloco prepare`` and its worker processes never load torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_HOMES = {
    "corpus": ("Corpus", "StreamingCorpus", "TokenCorpus", "load_corpus", "split_text", "training_texts"),
    "sources": ("BUNDLED", "DataError", "Source", "dataset_label", "iter_records", "read_text", "resolve_source",
                "source_from_config"),
    "streams": ("PackedStream", "TokenStream", "spread", "validation_blocks"),
    "tokenization": ("DESCRIPTION_FILE", "SAVED_DIR", "ByteTokenizer", "HFTokenizer", "Tokenizer",
                     "build_tokenizer", "exported_tokenizer", "get_tokenizer", "load_pretrained",
                     "save_byte_tokenizer", "save_tokenizer", "train_bpe"),
    "token_files": ("names_token_files", "open_token_source"),
    "sampling": ("WindowOrder", "WindowStream"),
    "windows": ("TokenWindows",),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "BUNDLED",
    "ByteTokenizer",
    "Corpus",
    "DESCRIPTION_FILE",
    "DataError",
    "HFTokenizer",
    "PackedStream",
    "SAVED_DIR",
    "Source",
    "StreamingCorpus",
    "TokenCorpus",
    "TokenStream",
    "TokenWindows",
    "Tokenizer",
    "WindowOrder",
    "WindowStream",
    "build_tokenizer",
    "dataset_label",
    "exported_tokenizer",
    "get_tokenizer",
    "iter_records",
    "load_corpus",
    "load_pretrained",
    "names_token_files",
    "open_token_source",
    "read_text",
    "resolve_source",
    "save_byte_tokenizer",
    "save_tokenizer",
    "source_from_config",
    "split_text",
    "spread",
    "train_bpe",
    "training_texts",
    "validation_blocks",
]

if TYPE_CHECKING:
    from adloco.data.corpus import Corpus, StreamingCorpus, TokenCorpus, load_corpus, split_text, training_texts
    from adloco.data.sampling import WindowOrder, WindowStream
    from adloco.data.sources import (
        BUNDLED,
        DataError,
        Source,
        dataset_label,
        iter_records,
        read_text,
        resolve_source,
        source_from_config,
    )
    from adloco.data.streams import PackedStream, TokenStream, spread, validation_blocks
    from adloco.data.token_files import names_token_files, open_token_source
    from adloco.data.tokenization import (
        DESCRIPTION_FILE,
        SAVED_DIR,
        ByteTokenizer,
        HFTokenizer,
        Tokenizer,
        build_tokenizer,
        exported_tokenizer,
        get_tokenizer,
        load_pretrained,
        save_byte_tokenizer,
        save_tokenizer,
        train_bpe,
    )
    from adloco.data.windows import TokenWindows


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'adloco.data' has no attribute {name!r}")
    return getattr(import_module(f"adloco.data.{module}"), name)
