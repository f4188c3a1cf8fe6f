"""Corpora, tokenizers and deterministic, resumable per-worker token streams.

Sources (``sources``): the bundled corpus, text files and folders, JSON Lines, Parquet and Hugging Face
``datasets``. Tokenizers (``tokenization``): bytes, a trained byte-level BPE, any Hugging Face tokenizer.
Streams (``streams``): random windows over an in-memory split, or packed windows read lazily.
"""

from adloco.data.corpus import Corpus, StreamingCorpus, load_corpus, split_text, training_texts
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

__all__ = [
    "BUNDLED",
    "DESCRIPTION_FILE",
    "SAVED_DIR",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "HFTokenizer",
    "PackedStream",
    "Source",
    "StreamingCorpus",
    "TokenStream",
    "Tokenizer",
    "build_tokenizer",
    "dataset_label",
    "exported_tokenizer",
    "get_tokenizer",
    "iter_records",
    "load_corpus",
    "load_pretrained",
    "read_text",
    "resolve_source",
    "save_byte_tokenizer",
    "save_tokenizer",
    "source_from_config",
    "split_text",
    "train_bpe",
    "training_texts",
    "spread",
    "validation_blocks",
]
