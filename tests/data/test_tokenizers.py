import pytest
import torch

from adloco.config import build_config
from adloco.data import (
    DataError,
    HFTokenizer,
    build_tokenizer,
    get_tokenizer,
    load_corpus,
    load_pretrained,
    source_from_config,
    train_bpe,
    training_texts,
)
from tests.data.helpers import document, write_jsonl

TEXTS = [document(i, 40) + "\nnaïve — 東京\n" for i in range(60)]


def test_bpe_is_deterministic_lossless_and_sized_as_asked():
    a, b = train_bpe(TEXTS, 300), train_bpe(list(TEXTS), 300)
    assert a.vocab_size == 300
    assert a.tokenizer.backend_tokenizer.to_str() == b.tokenizer.backend_tokenizer.to_str()
    text = "".join(TEXTS[:3]) + " unseen: ☃ \x01 zebra"
    ids = a.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < a.vocab_size
    assert a.decode(ids) == text  # byte-level: any text, even characters never seen in training
    assert len(ids) < len(text.encode()) / 2  # it learnt merges: far fewer tokens than bytes


def test_bpe_trains_on_the_training_split_only(tmp_path):
    texts = write_jsonl(tmp_path / "d.jsonl", 50)
    # The validation tail holds a word the training part never contains.
    with (tmp_path / "d.jsonl").open("a") as handle:
        handle.write('{"text": "' + "zyzzyva " * 100 + '"}\n')
    config = build_config(
        overrides=[f"data.dataset={tmp_path / 'd.jsonl'}", "data.tokenizer=bpe", "data.vocab_size=400"]
    )
    source = source_from_config(config.data)
    tokenizer = build_tokenizer(config.data, training_texts(config.data, source))
    assert not any("zyzz" in token for token in tokenizer.tokenizer.get_vocab())
    corpus = load_corpus(config.data, tokenizer, 16, source)
    assert tokenizer.decode(corpus.train[:30]) == texts[0][: len(tokenizer.decode(corpus.train[:30]))]
    assert "zyzzyva" in tokenizer.decode(corpus.val)


def test_saved_tokenizer_reloads_exactly_and_a_resume_never_retrains(tmp_path):
    tokenizer = train_bpe(TEXTS, 320)
    tokenizer.save(tmp_path / "tok")
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = TEXTS[5]
    assert plain(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text).tolist()
    # Batched, padded calls work on the saved tokenizer: padding uses the end-of-text token and is masked.
    batch = plain(["a", TEXTS[1]], padding=True, return_tensors="pt")
    assert plain.pad_token == plain.eos_token and batch["input_ids"].shape[0] == 2
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()
    config = build_config(overrides=["data.tokenizer=bpe", "data.vocab_size=999"])
    # With a saved tokenizer the training texts are never read and vocab_size is not used again.
    reloaded = build_tokenizer(config.data, training_texts=None, saved=tmp_path / "tok")
    assert reloaded.vocab_size == 320 and torch.equal(reloaded.encode(text), tokenizer.encode(text))
    with pytest.raises(DataError, match="no saved tokenizer"):
        build_tokenizer(config.data, None, saved=tmp_path / "missing")


def test_a_hugging_face_tokenizer_from_a_local_folder(tmp_path):
    from transformers import PreTrainedTokenizerFast

    base = train_bpe(TEXTS, 290)
    fast = PreTrainedTokenizerFast(tokenizer_object=base.tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    fast.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": ["<sep>"]})
    fast.save_pretrained(tmp_path / "hf-tok")
    config = build_config(overrides=[f"data.tokenizer={tmp_path / 'hf-tok'}"])
    tokenizer = build_tokenizer(config.data, None)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == 292  # added tokens count: the model's embedding must cover their ids
    assert tokenizer.decode(tokenizer.encode(TEXTS[1])) == TEXTS[1]
    assert tokenizer.describe()["type"] == "hf"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bytes", "is not 'byte', 'bpe', hf:NAME or an existing tokenizer folder"),
        ("hf:adloco-test/definitely-not-here", "is not in the local Hugging Face cache and offline mode is on"),
    ],
)
def test_bad_tokenizers_are_one_line_errors(spec, message):
    with pytest.raises(DataError, match=message) as caught:
        get_tokenizer(spec)
    assert "\n" not in str(caught.value)


def test_an_empty_folder_is_not_a_tokenizer(tmp_path):
    with pytest.raises(DataError, match="cannot be loaded"):
        load_pretrained(str(tmp_path))
