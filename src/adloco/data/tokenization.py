"""Tokenizers: bytes, a byte-level BPE trained on the training split, or any Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from adloco.data.encoding import byte_symbols
from adloco.data.hub import looks_local, not_found_offline, offline_message, offline_reason
from adloco.data.sources import HF_PREFIX, DataError, first_line
from adloco.data.token_files import check_resumed_tokenizer

if TYPE_CHECKING:
    from adloco.config import DataConfig

# The only special token of a trained BPE: marks the end of a text for tools that want one (never inserted).
END_OF_TEXT = "<|endoftext|>"
SAVED_DIR = "tokenizer"
DESCRIPTION_FILE = "adloco_tokenizer.json"


class Tokenizer(Protocol):
    """What training and inference need from a tokenizer."""

    vocab_size: int
    name: str

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: torch.Tensor | list[int]) -> str: ...

    def describe(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no special tokens, lossless on any text."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> torch.Tensor:
        raw = text.encode("utf-8")
        if not raw:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size, "encoding": "utf-8"}


class HFTokenizer:
    """A Hugging Face tokenizer (a trained BPE, or one loaded from a folder or the hub)."""

    def __init__(self, tokenizer: Any, name: str, origin: str) -> None:
        self.tokenizer = tokenizer
        self.name = name  # "bpe" or "hf"
        self.origin = origin
        # Added tokens have ids past the base vocabulary; the model's embedding must cover them too.
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> torch.Tensor:
        if getattr(self.tokenizer, "is_fast", False):
            # The backend does not warn about texts longer than the model's maximum length.
            ids = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False, verbose=False)
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else [int(v) for v in ids]
        return self.tokenizer.decode(values, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "source": self.origin}

    def save(self, directory: Path) -> None:
        """Write the tokenizer so that ``AutoTokenizer.from_pretrained(directory)`` loads it back."""
        self.tokenizer.save_pretrained(str(directory))


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE learned from ``texts``; the same texts and size give the same tokenizer."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = RustTokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    # GPT-2's convention: the end-of-text token also pads, so that batched calls in transformers work on the export.
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)
    return HFTokenizer(fast, "bpe", f"trained, vocab_size={vocab_size}")


def load_pretrained(spec: str, name: str = "hf") -> HFTokenizer:
    """``AutoTokenizer.from_pretrained`` on a local folder, or on a hub name given as ``hf:NAME``."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    target = spec[len(HF_PREFIX) :] if spec.startswith(HF_PREFIX) else spec
    if not spec.startswith(HF_PREFIX) and not Path(target).is_dir():
        raise DataError(f"tokenizer '{spec}' is not 'byte', 'bpe', hf:NAME or an existing tokenizer folder")
    hf_logging.set_verbosity_error()
    reason = None if looks_local(target) else offline_reason()
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception as error:  # transformers reports a missing or broken tokenizer many ways
        why = not_found_offline(error, reason)
        if why is not None:
            raise DataError(offline_message("tokenizer", target, why)) from None
        raise DataError(f"tokenizer '{spec}' cannot be loaded: {first_line(error)}") from None
    if len(tokenizer) < 2:
        raise DataError(f"tokenizer '{spec}' has a vocabulary of {len(tokenizer)}")
    return HFTokenizer(tokenizer, name, spec)


def get_tokenizer(name: str) -> Tokenizer:
    """A tokenizer that needs no training: ``byte``, a tokenizer folder or ``hf:NAME``."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        raise DataError("the bpe tokenizer is trained per run: use build_tokenizer (or load it from a run)")
    return load_pretrained(name)


def build_tokenizer(data: DataConfig, training_texts: Iterable[str] | None, saved: Path | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names.

    ``saved`` is a run's ``tokenizer/`` folder: a resumed run reloads it instead of training or
    downloading again, so it keeps exactly the vocabulary it started with. ``training_texts`` (the
    training split) is only read when a BPE has to be trained.
    """
    if data.tokenizer == "byte":
        return ByteTokenizer()
    if saved is not None:
        if not saved.is_dir():
            raise DataError(f"run has no saved tokenizer ('{saved}'); it cannot resume with the same vocabulary")
        check_resumed_tokenizer(data.dataset, saved)  # a prepared folder must still hold the run's tokenizer
        return load_pretrained(str(saved), "bpe" if data.tokenizer == "bpe" else "hf")
    if data.tokenizer == "bpe":
        if training_texts is None:
            raise DataError("the bpe tokenizer needs the training split to be trained on")
        return train_bpe(_limit_chars(training_texts, data.bpe_max_chars), data.vocab_size)
    return load_pretrained(data.tokenizer)


def _limit_chars(texts: Iterable[str], limit: int) -> Iterator[str]:
    used = 0
    for text in texts:
        if used >= limit:
            return
        yield text[: limit - used]
        used += len(text)


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Save a trained or loaded tokenizer into ``directory`` (nothing to save for bytes)."""
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(directory)


def save_byte_tokenizer(directory: Path) -> None:
    """The byte tokenizer as a Hugging Face one (id = byte value), so ``AutoTokenizer`` loads an export of it."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in byte_symbols().items()}
    core = RustTokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every byte is its own token
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(str(directory))


def exported_tokenizer(final: Path, description: dict) -> Tokenizer:
    """The tokenizer next to an exported model, as its ``adloco_tokenizer.json`` ``description`` says."""
    kind = description.get("type", "byte")
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("bpe", "hf"):
        return load_pretrained(str(final), kind)
    raise DataError(f"'{final / DESCRIPTION_FILE}' names an unknown tokenizer type '{kind}'")
