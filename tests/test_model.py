import torch

from adloco.model import PRESETS, build_model, next_token_loss, parameter_count, preset_config


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
