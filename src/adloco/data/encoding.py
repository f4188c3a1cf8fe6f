"""Text into token ids for ``adloco prepare``: an encoder per process (bytes, ``tiktoken`` or ``tokenizers``), the
choice between them, and the pool of processes that encodes batches in order.

A byte-level BPE from a Hugging Face ``tokenizer.json`` becomes a ``tiktoken`` encoding: the same ids, several times
faster (one thread on the kernel's source: 12.0 MB/s against 1.4 for ``tokenizers``, docs/data.md).

Only tokenizers whose splitting both libraries express the same way are converted: a BPE model without a
normalizer, split either by the ByteLevel pre-tokenizer's own GPT-2 rule or by one ``Split`` regex followed by a
ByteLevel mapping without a rule of its own (LLaMA 3's layout). Anything else returns None and ``tokenizers``
encodes. The two libraries merge by different bookkeeping (tiktoken by the rank of the merged bytes, tokenizers
by the rank of the merge), so ``prepare`` compares them on the first pieces of every source before trusting the
conversion; either way the ids decode back to exactly the text's bytes.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adloco.data.token_files import DTYPES

if TYPE_CHECKING:
    from adloco.data.documents import Piece

# GPT-2's split rule, which the ByteLevel pre-tokenizer applies when use_regex is on
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_symbols() -> dict[int, str]:
    """The printable character byte-level tokenizers show for each byte (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


@cache
def _unicode_to_byte() -> dict[str, int]:
    return {symbol: byte for byte, symbol in byte_symbols().items()}


def _split_rule(pre_tokenizer: dict[str, Any] | None) -> str | None:
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return GPT2_SPLIT
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers", [])
    if len(steps) != 2:
        return None
    split, level = steps
    pattern = split.get("pattern", {})
    if (split.get("type") != "Split" or "Regex" not in pattern or split.get("behavior") != "Isolated"
            or split.get("invert") or level.get("type") != "ByteLevel" or level.get("use_regex", True)
            or level.get("add_prefix_space")):  # fmt: skip
        return None
    return pattern["Regex"]


def tiktoken_encoding(tokenizer_json: str | Path) -> Any | None:
    """The tokenizer as a ``tiktoken.Encoding``, or None where it cannot be converted (or tiktoken is missing)."""
    try:
        import tiktoken
    except ImportError:
        return None
    spec = json.loads(Path(tokenizer_json).read_text())
    model = spec.get("model", {})
    rule = _split_rule(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or spec.get("normalizer") or rule is None or model.get("byte_fallback"):
        return None
    to_byte = _unicode_to_byte()
    added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
    ranks: dict[bytes, int] = {}
    for token, token_id in model.get("vocab", {}).items():
        if token in added:
            continue
        if any(ch not in to_byte for ch in token):
            return None
        ranks[bytes(to_byte[ch] for ch in token)] = int(token_id)
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        return None  # tiktoken needs every single byte to be a token
    try:
        return tiktoken.Encoding("adloco-bpe", pat_str=rule, mergeable_ranks=ranks, special_tokens=added)
    except Exception:  # a rule tiktoken's regex engine does not take, or ranks it refuses
        return None


class Encoder:
    """Turns pieces into token ids (an end-of-document id after a document's last piece); one per process.
    ``engine``: byte, tiktoken (a byte-level BPE converted by ``tiktoken_encoding``) or tokenizers."""

    def __init__(self, engine: str, file: str | None, eot: int, dtype: str) -> None:
        self.engine, self.eot, self.dtype = engine, eot, DTYPES[dtype]
        self.core: Any = None
        if engine == "tiktoken":
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
    if file is None or tiktoken_encoding(file) is None:
        return "tokenizers"
    sample, size = [], 0
    for piece in pieces:
        sample.append(piece.text)
        size += len(piece.text)
        if size >= SAMPLE_CHARS:
            break
    fast, exact = Encoder("tiktoken", file, 0, "uint32"), Encoder("tokenizers", file, 0, "uint32")
    same = all(np.array_equal(a, b) for a, b in zip(fast.ids(sample), exact.ids(sample), strict=True))
    return "tiktoken" if same else "tokenizers"


_ENCODER: Encoder | None = None


def _start_encoder(kind: str, file: str | None, eot: int, dtype: str) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = Encoder(kind, file, eot, dtype)


def _encode_in_process(pieces: list[Piece]) -> list[tuple[Piece, np.ndarray, int]]:
    assert _ENCODER is not None
    return _ENCODER.encode(pieces)


def encode_batches(batches: Iterator[list[Piece]], encoder_args: tuple, processes: int) -> Iterator[list[tuple]]:
    """Each batch encoded, in order; with several processes, a bounded number of batches in flight."""
    if processes == 1:
        encoder = Encoder(*encoder_args)
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
