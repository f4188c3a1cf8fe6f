import gzip
from importlib import resources

import pytest
import torch

from adloco.data import ByteTokenizer, Corpus, DataError, TokenStream, read_text, validation_blocks


def test_bundled_corpus_is_tiny_shakespeare():
    text = read_text("tinyshakespeare")
    assert len(text) == 1_115_394
    assert len(set(text)) == 65
    assert text.startswith("First Citizen:")
    blob = resources.files("adloco.data").joinpath("tinyshakespeare.txt.gz").read_bytes()
    assert len(blob) < len(text) / 2 and gzip.decompress(blob).decode() == text


def test_split_is_last_tenth_for_validation():
    tokenizer = ByteTokenizer()
    corpus = Corpus.load("tinyshakespeare", tokenizer, 0.1, 64)
    assert len(corpus.train) == int(1_115_394 * 0.9)
    assert len(corpus.train) + len(corpus.val) == 1_115_394
    assert tokenizer.decode(corpus.val[:20]) == read_text("tinyshakespeare")[len(corpus.train) :][:20]


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    text = "naïve — 東京"
    ids = tokenizer.encode(text)
    assert int(ids.max()) < 256 and tokenizer.decode(ids) == text


def test_stream_targets_are_inputs_shifted_by_exactly_one():
    tokens = torch.arange(1000)
    stream = TokenStream(tokens, context=8, seed=0)
    x, y = stream.next_batch(5)
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(y, x + 1)


def test_stream_is_deterministic_and_resumable_with_any_batch_size():
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(3))
    a = TokenStream(tokens, 16, seed=7)
    first = [a.next_batch(b)[0] for b in (3, 1, 7)]
    state = a.state_dict()
    rest = [a.next_batch(b)[0] for b in (2, 9)]
    b = TokenStream(tokens, 16, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(first, [b.next_batch(s)[0] for s in (3, 1, 7)], strict=True))
    c = TokenStream(tokens, 16, seed=99)
    c.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(rest, [c.next_batch(s)[0] for s in (2, 9)], strict=True))
    other = TokenStream(tokens, 16, seed=8)
    assert not torch.equal(first[0], other.next_batch(3)[0])


def test_validation_blocks_cover_the_split_without_overlap():
    tokens = torch.arange(101)
    blocks = validation_blocks(tokens, 10)
    assert blocks.shape == (10, 11)
    assert torch.equal(blocks[:, 1:].reshape(-1), torch.arange(1, 101))


def test_a_limited_evaluation_reads_blocks_spread_over_the_whole_split():
    tokens = torch.arange(1001)
    blocks = validation_blocks(tokens, 10, limit=4)  # 100 blocks, 4 of them
    assert blocks[:, 0].tolist() == [0, 250, 500, 750]
    assert torch.equal(validation_blocks(tokens, 10, limit=1000), validation_blocks(tokens, 10))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "fewer than one context"),
        (b"\x00\x01binary", "binary"),
        (b"\xff\xfe\xfa abc" * 50, "not UTF-8"),
        (b"short text", "fewer than one context"),
    ],
)
def test_bad_data_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "data.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        Corpus.load(str(path), ByteTokenizer(), 0.1, 64)


def test_missing_data_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_text(str(tmp_path / "nope.txt"))
