import json

import pytest
import torch

from adloco.checkpoint import CheckpointError
from adloco.config import ConfigError
from adloco.models.build import PRESETS, build_model, next_token_loss, parameter_count, preset_config, resolve_model


def test_tiny_preset_shape_and_determinism():
    config = preset_config("tiny", 256)
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (4, 4, 128)
    assert config.max_position_embeddings == 64
    a, b = build_model(config, 0), build_model(config, 0)
    assert 0.5e6 < parameter_count(a) < 1.5e6
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = build_model(config, 1)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_presets_are_valid_configs():
    for name in PRESETS:
        config = preset_config(name, 256)
        assert config.hidden_size % config.num_attention_heads == 0


def _small_model():
    config = preset_config("tiny", 32, context=16)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 32, 64, 2
    return build_model(config, 0)


def test_loss_has_exactly_one_shift():
    """Our loss on (x, y) equals HF's own loss on the joined window: one shift, not two."""
    model = _small_model()
    window = torch.randint(0, 32, (3, 17), generator=torch.Generator().manual_seed(0))
    ours = next_token_loss(model, window[:, :-1], window[:, 1:])
    hf = model(input_ids=window[:, :-1], labels=window[:, :-1]).loss  # HF shifts labels internally
    full = torch.nn.functional.cross_entropy(
        model(input_ids=window[:, :-1]).logits.reshape(-1, 32), window[:, 1:].reshape(-1)
    )
    assert torch.allclose(ours, full)
    assert not torch.allclose(ours, hf)  # hf drops the last position: a different quantity


def test_training_on_a_shifted_sequence_learns_next_token():
    """A model trained with our loss on counting sequences predicts t+1, not t+2."""
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.arange(0, 16)
    for _ in range(150):
        window = (starts[:, None] + torch.arange(17)) % 32
        loss = next_token_loss(model, window[:, :-1], window[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    x = (torch.arange(5, 21) % 32)[None]
    prediction = model(input_ids=x).logits.argmax(-1)[0]
    assert torch.equal(prediction[4:], (x[0, 4:] + 1) % 32)


# --- any Hugging Face model: config files and checkpoints (written to tmp dirs, nothing downloaded) ---

TINY_CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 50257,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 64},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 32,
              "intermediate_size": 64, "max_position_embeddings": 64},
    "bert": {"model_type": "bert", "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 32,
             "intermediate_size": 64, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0},
}  # fmt: skip


def write_config(directory, name: str, **changes) -> str:
    path = directory / f"{name}.json"
    path.write_text(json.dumps({**TINY_CONFIGS[name], **changes}))
    return str(path)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_config_file_builds_a_seeded_model_with_the_tokenizer_vocabulary(tmp_path, name):
    spec = resolve_model(None, write_config(tmp_path, name), 16, 256)
    assert spec.config.vocab_size == 256 and spec.context == 16 and spec.checkpoint is None
    a, b, c = spec.build(0), spec.build(0), spec.build(1)
    assert a.get_input_embeddings().weight.shape[0] == 256
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_every_architecture_gets_exactly_one_shift_and_attends_causally(tmp_path, name):
    model = resolve_model(None, write_config(tmp_path, name), 16, 256).build(0).eval()
    window = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    ours = next_token_loss(model, window[:, :-1], window[:, 1:])
    # HF shifts labels itself: given the whole window as labels it scores the same 16 predictions once.
    assert torch.allclose(ours, model(input_ids=window, labels=window).loss, atol=1e-5)
    changed = window.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    before = model(input_ids=window[:, :-1]).logits[:, :10]
    after = model(input_ids=changed[:, :-1]).logits[:, :10]
    assert torch.allclose(before, after, atol=1e-5)  # no position sees a later token (BERT runs as a decoder)


def test_context_defaults_to_the_models_positions_and_may_not_exceed_them(tmp_path):
    path = write_config(tmp_path, "gpt2")
    assert resolve_model(None, path, None, 256).context == 64
    with pytest.raises(ConfigError, match="model.context: 65 exceeds the model's 64 positions"):
        resolve_model(None, path, 65, 256)


def test_checkpoint_directory_gives_every_trainer_its_weights(tmp_path):
    saved = resolve_model(None, write_config(tmp_path, "gpt2"), 16, 256).build(3)
    saved.save_pretrained(tmp_path / "ckpt")
    spec = resolve_model(None, str(tmp_path / "ckpt"), 16, 256)
    assert spec.checkpoint == tmp_path / "ckpt" and spec.label == "ckpt"
    for seed in (0, 1):
        loaded = spec.build(seed)
        assert all(torch.equal(p, q) for p, q in zip(saved.parameters(), loaded.parameters(), strict=True))
    with pytest.raises(ConfigError, match="vocabulary has 256 tokens but the tokenizer has 300"):
        resolve_model(None, str(tmp_path / "ckpt"), 16, 300)


def test_unreadable_weights_are_a_checkpoint_error(tmp_path):
    resolve_model(None, write_config(tmp_path, "gpt2"), 16, 256).build(0).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot load the weights"):
        resolve_model(None, str(tmp_path / "ckpt"), 16, 256).build(0)
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="cannot load the weights"):
        resolve_model(None, str(tmp_path / "ckpt"), 16, 256).build(0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{not json", "is not JSON"),
        ('{"n_layer": 2}', "has no model_type"),
        ('{"model_type": "no-such-model"}', "unknown model_type 'no-such-model'"),
        ('{"model_type": "vit"}', "model_type 'vit' has no causal language model class"),
    ],
)
def test_bad_model_paths_are_one_line_config_errors(tmp_path, content, message):
    path = tmp_path / "model.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_model(None, str(path), 16, 256)
    assert "\n" not in str(error.value)


def test_cli_reports_a_bad_model_path_in_one_line_with_exit_2(tmp_path, capsys):
    from adloco.cli import main

    (tmp_path / "vit.json").write_text('{"model_type": "vit"}')
    assert main(["train", f"model.path={tmp_path / 'vit.json'}", f"run.root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adloco: error: model.path:") and "\n" not in err


@pytest.mark.parametrize("source", ["preset", "gpt2-config"])
def test_exported_language_model_loads_with_transformers_and_generates(tmp_path, source):
    from transformers import AutoModelForCausalLM

    from adloco.config import build_config
    from adloco.run.training import train
    from tests.conftest import FAST

    model = ["model.preset=tiny"] if source == "preset" else [f"model.path={write_config(tmp_path, 'gpt2')}"]
    config = build_config(overrides=[*FAST, *model, "total_tokens=256", f"run.root={tmp_path / 'runs'}"])
    result = train(config)
    if source == "gpt2-config":
        assert result.run_dir.name.startswith("gpt2_tinyshakespeare_")
    exported = AutoModelForCausalLM.from_pretrained(result.run_dir / "final")
    assert exported.config.model_type == ("llama" if source == "preset" else "gpt2")
    prompt = torch.tensor([list(b"ROMEO:")])
    out = exported.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 14) and torch.equal(out[:, :6], prompt) and int(out.max()) < 256
