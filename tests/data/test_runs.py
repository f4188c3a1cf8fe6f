"""Whole runs on other data and tokenizers: export, eval, sample and an exact streaming resume."""

import pytest
import torch

from adloco.checkpoint import list_checkpoints
from adloco.config import build_config
from adloco.run.training import train
from adloco.tools.inference import evaluate_run, sample
from tests.conftest import FAST, cut_back, final_params
from tests.data.helpers import write_jsonl, write_parquet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.training
def test_streaming_bpe_run_resumes_bit_identically_without_retraining(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", 120)
    overrides = [
        *FAST,
        "threads=1",
        f"run.root={tmp_path / 'runs'}",
        f"data.dataset={tmp_path / 'd.jsonl'}",
        "data.streaming=true",
        "data.val_documents=6",
        "data.shuffle_buffer=4",
        "data.tokenizer=bpe",
        "data.vocab_size=300",
        "checkpoint.every=1",
        "checkpoint.keep=10",
        "eval.final_full=true",
    ]
    config = build_config(overrides=overrides)
    full = train(config)
    assert len(list_checkpoints(full.run_dir / "checkpoints")) >= 3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(full.run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(full.run_dir / "final")
    assert model.config.vocab_size == len(tokenizer) == 300
    assert (full.run_dir / "tokenizer" / "tokenizer.json").is_file()

    partial = cut_back(full.run_dir, tmp_path / "partial", keep=1)

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed run must reload its tokenizer, not train a new one")

    monkeypatch.setattr("adloco.data.tokenization.train_bpe", no_training)
    resumed = train(config, resume=partial)
    expected, got = final_params(full.run_dir), final_params(partial)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert resumed.val_loss == full.val_loss and resumed.tokens == full.tokens
    assert evaluate_run(partial)[0] == pytest.approx(full.val_loss, rel=1e-6)


def test_parquet_run_with_a_local_hugging_face_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from adloco.data import train_bpe

    texts = write_parquet(tmp_path / "d.parquet", 80)
    base = train_bpe(texts[:60], 280)
    saved = PreTrainedTokenizerFast(tokenizer_object=base.tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    saved.add_special_tokens({"pad_token": "<pad>"})
    saved.save_pretrained(tmp_path / "my-tokenizer")
    overrides = [
        *FAST,
        "threads=1",
        "total_tokens=512",
        "eval.final_full=true",
        f"run.root={tmp_path / 'runs'}",
        f"data.dataset={tmp_path / 'd.parquet'}",
        f"data.tokenizer={tmp_path / 'my-tokenizer'}",
    ]
    result = train(build_config(overrides=overrides))
    final = result.run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.vocab_size == len(tokenizer) == 281
    loss, tokens = evaluate_run(result.run_dir)
    assert loss == pytest.approx(result.val_loss, rel=1e-6) and tokens > 0
    text = sample(result.run_dir, "doc7:", tokens=12, temperature=0, top_k=None, seed=0)
    assert text.startswith("doc7:") and len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= 12
