import pytest
import torch

from adloco.config import build_config
from adloco.data import ByteTokenizer, DataError, PackedStream, StreamingCorpus, load_corpus, resolve_source
from tests.data.helpers import write_jsonl, write_parquet

CONTEXT = 16


def _windows(stream: PackedStream, sizes: list[int]) -> list[torch.Tensor]:
    out = []
    for size in sizes:
        x, y = stream.next_batch(size)
        assert torch.equal(x[:, 1:], y[:, :-1])  # exactly one shift between inputs and targets
        out.append(torch.cat([x, y[:, -1:]], dim=1))
    return out


def test_workers_read_disjoint_round_robin_shares_packed_back_to_back(tmp_path):
    texts = write_jsonl(tmp_path / "d.jsonl", 40)
    corpus = StreamingCorpus.load(resolve_source(str(tmp_path / "d.jsonl")), ByteTokenizer(), CONTEXT, 4, 1)
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(corpus.val) == "".join(t + "\n\n" for t in texts[:4])
    for worker in range(3):
        stream = corpus.stream(CONTEXT, seed=worker, worker=worker, workers=3)
        windows = torch.cat(_windows(stream, [5, 5]))
        # Consecutive windows overlap by one token, so every token is a target exactly once.
        assert torch.equal(windows[1:, 0], windows[:-1, -1])
        packed = torch.cat([windows[0], windows[1:, 1:].reshape(-1)])
        mine = "".join(t + "\n\n" for i, t in enumerate(texts) if i >= 4 and (i - 4) % 3 == worker)
        assert tokenizer.decode(packed) == mine[: len(packed)]


@pytest.mark.parametrize("shuffle_buffer", [1, 8])
def test_a_restored_stream_continues_bit_identically_across_epochs(tmp_path, shuffle_buffer):
    write_parquet(tmp_path / "d.parquet", 30, row_group_size=4)
    corpus = StreamingCorpus.load(
        resolve_source(str(tmp_path / "d.parquet")), ByteTokenizer(), CONTEXT, 2, shuffle_buffer
    )
    sizes = [3, 1, 7, 2, 40, 5, 160, 9]  # long enough to wrap past the end of the corpus into epoch 2
    reference = _windows(corpus.stream(CONTEXT, seed=5, worker=1, workers=2), sizes)
    stream = corpus.stream(CONTEXT, seed=5, worker=1, workers=2)
    head = _windows(stream, sizes[:4])
    state = stream.state_dict()
    restored = corpus.stream(CONTEXT, seed=123, worker=1, workers=2)  # the state, not the seed, is the cursor
    restored.load_state_dict(state)
    tail = _windows(restored, sizes[4:])
    assert restored.epoch >= 1
    assert all(torch.equal(a, b) for a, b in zip(reference, head + tail, strict=True))
    if shuffle_buffer > 1:
        other = _windows(corpus.stream(CONTEXT, seed=6, worker=1, workers=2), sizes[:1])
        assert not torch.equal(other[0], reference[0])


def test_a_stream_holds_a_bounded_buffer_not_the_corpus(tmp_path):
    write_jsonl(tmp_path / "big.jsonl", 3000)
    corpus_bytes = (tmp_path / "big.jsonl").stat().st_size
    corpus = StreamingCorpus.load(resolve_source(str(tmp_path / "big.jsonl")), ByteTokenizer(), CONTEXT, 8, 16)
    stream = corpus.stream(CONTEXT, seed=0, worker=0, workers=2)
    for _ in range(20):
        stream.next_batch(4)
    state = stream.state_dict()
    held = sum(v.numel() for v in (state["pending"], state["buffer"], *stream.buffer))
    longest_document = 300
    assert held <= 2 * 16 * (CONTEXT + 1) + longest_document + CONTEXT < corpus_bytes / 100
    assert stream.document < 200 and stream.epoch == 0  # it has read only what it needed so far
    assert corpus.val.numel() < 8 * longest_document


def test_streaming_validation_is_the_first_documents_whatever_the_workers(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", 50)
    overrides = [f"data.dataset={tmp_path / 'd.jsonl'}", "data.streaming=true", "data.val_documents=5"]
    a = load_corpus(build_config(overrides=overrides).data, ByteTokenizer(), CONTEXT)
    b = load_corpus(build_config(overrides=[*overrides, "workers=8", "seed=3"]).data, ByteTokenizer(), CONTEXT)
    assert isinstance(a, StreamingCorpus) and torch.equal(a.val, b.val)


def test_text_files_stream_line_by_line(tmp_path):
    lines = [f"line {i} " + "abc " * (i % 5) + "\n" for i in range(60)]
    (tmp_path / "t.txt").write_text("".join(lines))
    corpus = StreamingCorpus.load(resolve_source(str(tmp_path / "t.txt")), ByteTokenizer(), CONTEXT, 10, 1)
    assert ByteTokenizer().decode(corpus.val) == "".join(lines[:10])
    stream = corpus.stream(CONTEXT, seed=0, worker=0, workers=1)
    windows = torch.cat(_windows(stream, [4]))
    packed = torch.cat([windows[0], windows[1:, 1:].reshape(-1)])
    assert ByteTokenizer().decode(packed) == "".join(lines[10:])[: len(packed)]


def test_streaming_errors(tmp_path):
    write_jsonl(tmp_path / "few.jsonl", 6)
    source = resolve_source(str(tmp_path / "few.jsonl"))
    with pytest.raises(DataError, match="has 6 documents; streaming holds out the first 6"):
        StreamingCorpus.load(source, ByteTokenizer(), CONTEXT, 6, 1)
    corpus = StreamingCorpus.load(source, ByteTokenizer(), CONTEXT, 4, 1)
    with pytest.raises(DataError, match="2 training documents .* too few for 3 workers"):
        corpus.stream(CONTEXT, seed=0, worker=2, workers=3).next_batch(1)
