"""task=classification end to end: a tiny BERT on a small labelled file written here, every method, the
export, resume, other Hugging Face models and the errors a bad labelled file gives."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from adloco.checkpoint import list_checkpoints
from adloco.config import build_config
from adloco.config.input import layered
from adloco.data import ByteTokenizer, DataError
from adloco.data.labelled import LabelledRows, LabelledSplit, label_names, read_labelled
from adloco.metrics.writer import read_metrics
from adloco.models.build import build_model, classification_loss, preset_config, resolve_model
from adloco.run.training import train
from tests.conftest import FAST, cut_back, final_params, same_params

FILLER = ["the", "a", "film", "plot", "was", "it", "so", "and", "cast", "very"]
KEYWORDS = {"pos": "good", "neg": "bad"}

# One thread: the machine running the suite has two cores shared with other work, where two threads per
# process thrash. Classification rows cost their context (16) in the token budget.
CLASSIFY = layered(FAST, ["task=classification", "threads=1", "batch.size=4", "run.trackers=[]"])


def keyword_rows(count: int, seed: int) -> list[dict]:
    """Short reviews whose label is decided by one keyword at a random place among filler words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.choice(sorted(KEYWORDS))
        words = [rng.choice(FILLER) for _ in range(2)]  # at most 14 bytes: the keyword always fits the context
        words.insert(rng.randrange(3), KEYWORDS[label])
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def reviews(tmp_path) -> tuple[Path, Path]:
    """A training file of 400 rows and a separate validation file of 64."""
    return (
        write_jsonl(tmp_path / "reviews.jsonl", keyword_rows(400, seed=0)),
        write_jsonl(tmp_path / "reviews-val.jsonl", keyword_rows(64, seed=1)),
    )


def overrides(tmp_path: Path, dataset: Path, *more: str) -> list[str]:
    return layered(CLASSIFY, [f"data.dataset={dataset}", f"run.root={tmp_path / 'runs'}", *more])


def byte_rows(texts: list[str], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask for the byte tokenizer, padded with 0 as adloco pads them."""
    ids = torch.zeros((len(texts), context), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, text in enumerate(texts):
        tokens = list(text.encode())[:context]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return ids, mask


@pytest.mark.training
@pytest.mark.parametrize(("method", "tokens"), [("diloco", 6400), ("ddp", 6400)])
def test_training_learns_the_keyword_and_exports_a_sequence_classifier(tmp_path, reviews, capsys, method, tokens):
    from transformers import AutoModelForSequenceClassification

    from adloco.cli import main
    from adloco.tools.inference import evaluate_final

    train_file, val_file = reviews
    config = build_config(
        overrides=overrides(
            tmp_path,
            train_file,
            f"method={method}",
            f"data.val_dataset={val_file}",
            f"total_tokens={tokens}",
            "eval.final_full=true",
        )
    )
    assert config.model.preset == "tiny-bert"
    result = train(config)
    # 50 inner steps of 2 workers x 4 rows. Chance is ln 2 = 0.693 and accuracy 0.5;
    # seeds 0-2 reach val loss 0.003-0.16 (diloco) and 0.007-0.07 (ddp), accuracy 0.975-1.
    assert result.accuracy is not None and result.accuracy >= 0.9
    assert result.val_loss < 0.4 * math.log(2)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    evaluated = [r for r in records if r["kind"] == "round" and r["val_loss"] is not None]
    assert evaluated and all(0 <= r["val_accuracy"]["0"] <= 1 for r in evaluated)
    assert records[-1]["kind"] == "final" and records[-1]["validation_samples"] == 64
    assert records[-1]["accuracy"]["0"] == result.accuracy
    assert records[-1]["tokens"] == result.tokens and result.tokens % 16 == 0  # rows count their full context

    model = AutoModelForSequenceClassification.from_pretrained(result.run_dir / "final").eval()
    assert model.config.model_type == "bert" and model.config.id2label == {0: "neg", 1: "pos"}
    fresh = keyword_rows(32, seed=2)  # rows neither split holds
    ids, mask = byte_rows([r["text"] for r in fresh], context=16)
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    hits = sum(model.config.id2label[int(p)] == r["label"] for p, r in zip(predicted, fresh, strict=True))
    assert hits >= 0.9 * len(fresh)

    # `adloco eval` scores the export on the whole validation file exactly as the run's final evaluation did
    evaluation = evaluate_final(result.run_dir)
    assert evaluation.count == 64 and evaluation.accuracy == result.accuracy
    assert evaluation.loss == pytest.approx(result.val_loss, rel=1e-5)
    assert main(["eval", str(result.run_dir)]) == 0
    assert f"accuracy {result.accuracy:.4f} over 64 samples" in capsys.readouterr().out
    # a classifier generates nothing: `adloco sample` says so in one line
    assert main(["sample", str(result.run_dir), "--prompt", "the"]) == 2
    err = capsys.readouterr().err.strip()
    assert "classification run" in err and "\n" not in err


@pytest.mark.parametrize(
    "method",
    [["method=localsgd"], ["method=streaming"], ["method=adloco", "trainers=2", "merge.every=2", "batch.b_cap=8"]],
    ids=lambda m: m[0].split("=")[1],
)
def test_every_other_method_trains_a_classifier(tmp_path, reviews, method):
    result = train(build_config(overrides=overrides(tmp_path, reviews[0], "total_tokens=1920", *method)))
    assert math.isfinite(result.val_loss) and result.accuracy is not None and 0 <= result.accuracy <= 1
    records = read_metrics(result.run_dir / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds[-1]["tokens"] == result.tokens >= 1920 and records[-1]["kind"] == "final"
    assert all(math.isfinite(loss) for r in rounds for loss in r["train_loss"].values())
    assert (result.run_dir / "final" / "model.safetensors").exists()
    if method[0] == "method=adloco":
        assert any(r["kind"] == "merge" for r in records) and len(records[-1]["accuracy"]) == 1


@pytest.mark.training
def test_resuming_a_classification_run_is_bit_identical(tmp_path, reviews):
    config = build_config(
        overrides=overrides(tmp_path, reviews[0], "total_tokens=2048", "checkpoint.every=1", "checkpoint.keep=100")
    )
    full = train(config)
    assert len(list_checkpoints(full.run_dir / "checkpoints")) == 4  # 16 steps of 8 rows, H = 4
    partial = cut_back(full.run_dir, tmp_path / "partial", keep=2)  # as if the process died after round 2
    resumed = train(config, resume=partial)
    assert same_params(final_params(full.run_dir), final_params(partial))
    assert (resumed.val_loss, resumed.accuracy, resumed.tokens) == (full.val_loss, full.accuracy, full.tokens)
    full_rounds = [r for r in read_metrics(full.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    resumed_rounds = [r for r in read_metrics(partial / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["train_loss"] for r in resumed_rounds] == [r["train_loss"] for r in full_rounds]


@pytest.mark.parametrize("source", ["gpt2-config", "llama-checkpoint"])
def test_other_hugging_face_models_classify(tmp_path, reviews, source):
    """A decoder config file gets a classification head; a causal-LM checkpoint keeps its body and gets a
    fresh head (what fine-tuning a pretrained model for classification looks like)."""
    from transformers import AutoModelForSequenceClassification

    if source == "gpt2-config":
        path = tmp_path / "gpt2.json"
        path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 32}))
    else:
        config = preset_config("tiny", 256, context=32)
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = 32, 64, 1
        pretrained = build_model(config, seed=7)
        path = tmp_path / "pretrained"
        pretrained.save_pretrained(path)
    result = train(build_config(overrides=overrides(tmp_path, reviews[0], f"model.path={path}", "total_tokens=640")))
    model = AutoModelForSequenceClassification.from_pretrained(result.run_dir / "final")
    assert model.config.model_type == source.split("-")[0] and model.config.num_labels == 2
    assert model.config.pad_token_id == 0  # decoders pool the last token that is not padding
    ids, mask = byte_rows(["good film", "bad plot"], context=16)
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (2, 2)
    if source == "llama-checkpoint":
        # the body starts from the checkpoint: 5 small steps away from it, not a fresh random draw (std 0.02)
        start, end = pretrained.model.embed_tokens.weight.detach(), model.model.embed_tokens.weight.detach()
        assert not torch.equal(start, end) and float((start - end).abs().max()) < 0.02
        assert float((build_model(config, seed=8).model.embed_tokens.weight.detach() - start).abs().max()) > 0.05
        assert not hasattr(model, "lm_head") and model.score.weight.shape == (2, 32)


def test_padding_is_masked_out_of_the_prediction():
    """Rows shorter than the context are padded; what the padding holds must not change a row's logits."""
    rows = LabelledRows(["good film", "it was so bad"], ["pos", "neg"], "test")
    split = LabelledSplit.encode(rows, ByteTokenizer(), 16, 0, ["neg", "pos"])
    assert split.attention_mask.sum(1).tolist() == [9, 13] and split.labels.tolist() == [1, 0]
    assert torch.equal(split.input_ids[0, :9], torch.tensor(list(b"good film")))
    spec = resolve_model("tiny-bert", None, 16, 256, "classification", ["neg", "pos"])
    model = spec.build(0).eval()
    junk = split.input_ids.clone()
    junk[split.attention_mask == 0] = 101
    with torch.no_grad():
        clean = model(input_ids=split.input_ids, attention_mask=split.attention_mask).logits
        noisy = model(input_ids=junk, attention_mask=split.attention_mask).logits
        assert torch.allclose(clean, noisy, atol=1e-5)
        loss = classification_loss(model, split.input_ids, split.attention_mask, split.labels)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(clean, split.labels), atol=1e-6)


def word_tokenizer(directory: Path, pad: bool) -> Path:
    """A local Hugging Face word-level tokenizer folder whose id 0 is a real word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*FILLER, *KEYWORDS.values(), "<unk>", "</s>", *(["<pad>"] if pad else [])]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "<pad>"} if pad else {}
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>", **special).save_pretrained(
        directory
    )
    return directory


@pytest.mark.parametrize("pad", [True, False])
def test_a_hugging_face_tokenizer_pads_with_its_padding_or_end_token(tmp_path, reviews, pad):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = word_tokenizer(tmp_path / "tokenizer", pad)
    result = train(
        build_config(overrides=overrides(tmp_path, reviews[0], f"data.tokenizer={folder}", "total_tokens=640"))
    )
    model = AutoModelForSequenceClassification.from_pretrained(result.run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(result.run_dir / "final")
    expected = tokenizer.pad_token_id if pad else tokenizer.eos_token_id
    assert model.config.pad_token_id == expected == len(FILLER) + len(KEYWORDS) + (2 if pad else 1)
    assert tokenizer.convert_ids_to_tokens(0) == "the"  # id 0 is a word: padding with it would hide "the"
    assert model.config.vocab_size == len(tokenizer)


def test_labels_get_ids_in_sorted_order(tmp_path):
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("text,label\na,10\nb,2\nc, 02\nd,-1\n")
    rows = read_labelled(str(numbers), "text", "label")
    assert label_names(rows) == ["-1", "2", "10"]  # integers sort as numbers, " 02" is 2
    words = write_jsonl(tmp_path / "words.jsonl", [{"t": "a", "y": "pos"}, {"t": "b", "y": "neg"}, {"t": "c", "y": 3}])
    assert label_names(read_labelled(str(words), "t", "y")) == ["3", "neg", "pos"]
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("label\ttext\n1\tcomma, inside\n0\tb\n")
    assert read_labelled(str(tsv), "text", "label").texts == ["comma, inside", "b"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"review": ["good", "bad", "fine"], "stars": [5, 1, 4]}), tmp_path / "rows.parquet")
    rows = read_labelled(str(tmp_path / "rows.parquet"), "review", "stars")
    assert rows.texts == ["good", "bad", "fine"] and label_names(rows) == ["1", "4", "5"]


BAD_FILES = [
    ("rows.jsonl", '{"text": "good"}\n', "row 1 has no field 'label' (fields: text); set data.label_field"),
    ("rows.csv", "text,sentiment\ngood,1\n", "row 1 has no field 'label' (fields: text, sentiment)"),
    ("rows.jsonl", '{"text": "good", "label": 1}\n{"text": "bad", "label": 1}\n', "has only one label (1)"),
    ("rows.jsonl", '{"text": "good", "label": 0.5}\n', "row 1: label 0.5 is not an integer or a non-empty string"),
    ("rows.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": true}\n', "row 2: label True is not"),
    ("rows.jsonl", '{"text": "good", "label": ["a"]}\n', "label ['a'] is not an integer or a non-empty string"),
    ("rows.csv", "text,label\ngood,\n", "row 1: label '' is not an integer or a non-empty string"),
    ("rows.jsonl", '{"text": "", "label": 1}\n', "row 1: field 'text' must be a non-empty text"),
    ("rows.jsonl", "", "has no rows"),
    ("rows.csv", "text,label\n", "has no rows"),
    ("rows.jsonl", "{broken\n", "line 1 is not valid JSON"),
    ("rows.txt", "good\n", "must be .jsonl, .csv, .tsv or .parquet"),
    ("rows.jsonl", '{"text": "good", "label": 1}\n', "too few to hold out data.val_fraction=0.1"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES)
def test_a_bad_labelled_file_is_a_one_line_data_error(tmp_path, capsys, name, content, message):
    from adloco.cli import main

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as error:
        train(build_config(overrides=overrides(tmp_path, path)))
    assert "\n" not in str(error.value) and name in str(error.value)
    assert main(["train", *overrides(tmp_path, path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"adloco: error: {error.value}"
    assert not (tmp_path / "runs").exists()  # nothing is written for a run that cannot start


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["data.dataset=tinyshakespeare"], "needs a labelled file in data.dataset"),
        (["data.dataset=missing.jsonl"], "labelled data file 'missing.jsonl' does not exist"),
        (["data.val_dataset=missing.jsonl"], "labelled data file 'missing.jsonl' does not exist"),
    ],
)
def test_a_missing_labelled_file_is_a_one_line_error(tmp_path, reviews, capsys, more, message):
    from adloco.cli import main

    assert main(["train", *layered(overrides(tmp_path, reviews[0]), more)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adloco: error: ") and message in err and "\n" not in err


def test_classification_settings_are_checked_before_anything_runs():
    from adloco.config import ConfigError

    with pytest.raises(ConfigError, match="tiny-bert is an encoder for task=classification"):
        build_config(overrides=["model.preset=tiny-bert"])
    with pytest.raises(ConfigError, match="a separate validation file is read by task=classification and by .bin"):
        build_config(overrides=["data.val_dataset=val.jsonl"])
