"""The data pipeline benchmark's own code, run small: a synthetic prepared folder, throughput, resume, the table."""

import data_pipeline
import numpy as np

from adloco.data.token_files import open_token_source


def test_the_benchmark_measures_what_training_reads_and_renders_its_table(tmp_path):
    folder = data_pipeline.synthetic_folder(tmp_path / "synthetic", 50_000, shard_tokens=20_000)
    source = open_token_source(str(folder), None, 0.1, verify=True)  # a folder training accepts, checksums and all
    assert len(source.train) == 50_000 and len(source.train.files) == 3
    assert int(source.train.gather(np.array([0]), 50_000).max()) < 256
    speed = data_pipeline.throughput(folder, context=16, batch=2, batches=20, repeats=1)
    assert speed["token_files_tokens_per_s"] > 0 and speed["folder_tokens"] == 50_000
    late = data_pipeline.resume(10**9, context=16, batch=2, repeats=1, folder=folder)
    assert 0 < late["cursor_to_batch_s"] <= late["open_cursor_to_batch_s"]
    env = {"environment": {"date": "d", "adloco": "a", "torch": "t", "python": "p", "machine": "m"}}
    table = data_pipeline.render({"throughput": {**speed, **env}, "resume": {**late, **env}})
    assert "tokens/s" in table and "1,000,000,000 samples" in table and table.count("Measured d") == 1


def test_the_encoders_are_timed_on_the_same_text_and_compared(tmp_path):
    from rich.console import Console

    from adloco.data.prepare import PrepareSettings, prepare

    (tmp_path / "text").mkdir()
    for i in range(20):
        (tmp_path / "text" / f"{i}.c").write_text(f"int f{i}(void) {{ return {i} * {i}; }}\n" * 50)
    out = tmp_path / "tokens"
    prepare(PrepareSettings(str(tmp_path / "text"), "bpe", vocab_size=300, suffixes=(".c",)), out, Console(quiet=True))
    timed = data_pipeline.encoders(tmp_path / "text", out / "tokenizer", megabytes=0.01)
    assert timed["same_ids"] and timed["tokens"] > 0 and set(timed["mb_per_s"]) == {"tiktoken", "tokenizers"}
