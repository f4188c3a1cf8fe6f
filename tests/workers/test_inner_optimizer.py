"""The inner optimizer: Muon on the hidden matrices and AdamW on the rest, as one torch optimizer."""

import copy

import pytest
import torch

from adloco.config import InnerConfig
from adloco.models.build import build_model, preset_config
from adloco.workers.inner_optimizer import MuonWithAdamW, hidden_matrices, inner_optimizer, set_inner_lr


def _model():
    config = preset_config("tiny", 64, context=8)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 16, 32, 2
    return build_model(config, seed=0)


def _step(model, optimizer, seed):
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_muon_takes_the_hidden_matrices_and_adamw_embeddings_head_and_vectors():
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[id(p)].split(".")[-2] for p in hidden_matrices(model))
    assert chosen == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2)
    optimizer = inner_optimizer(model, InnerConfig(optimizer="muon"), {"foreach": False})
    muon_ids = {id(p) for p in optimizer.muon.param_groups[0]["params"]}
    adamw_names = {names[id(p)] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names
    assert muon_ids.isdisjoint({id(p) for g in optimizer.adamw.param_groups for p in g["params"]})


def test_its_state_dict_resumes_bit_identically_and_its_groups_are_the_two_optimizers():
    model = _model()
    optimizer = MuonWithAdamW(model.parameters(), hidden_matrices(model), lr=1e-3, muon_lr=4e-3)
    stepped = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(1))  # what DiLoCo hooks in a user's loop
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(2e-3)  # a scheduler reaches both halves
    assert optimizer.adamw.param_groups[0]["lr"] == pytest.approx(5e-4)
    for seed in range(2):
        _step(model, optimizer, seed)
        schedule.step()
    assert stepped == [1, 1]
    twin = copy.deepcopy(model)
    restored = MuonWithAdamW(twin.parameters(), hidden_matrices(twin), lr=1e-3, muon_lr=4e-3)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for seed in (5, 6):
        _step(model, optimizer, seed)
        _step(twin, restored, seed)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    kinds = {frozenset(state) for state in restored.state.values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}


def test_set_inner_lr_keeps_muons_ratio_to_the_adamw_lr():
    model = _model()
    optimizer = MuonWithAdamW(model.parameters(), hidden_matrices(model), lr=1e-3, muon_lr=3e-3)
    set_inner_lr(optimizer, 2e-3)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([6e-3, 2e-3, 2e-3])


def test_a_model_without_hidden_matrices_is_refused_with_its_reason():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4))
    with pytest.raises(ValueError, match="no hidden matrices"):
        MuonWithAdamW(model.parameters(), hidden_matrices(model))


def test_it_copies_whole_and_refuses_a_group_that_neither_half_would_step():
    """A deep copy (pickling) keeps both halves: torch's own keeps only the groups and the state."""
    model = _model()
    optimizer = MuonWithAdamW(model.parameters(), hidden_matrices(model))
    _step(model, optimizer, 0)
    copied = copy.deepcopy({"model": model, "optimizer": optimizer})
    _step(model, optimizer, 1)
    _step(copied["model"], copied["optimizer"], 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copied["model"].parameters(), strict=True))
    with pytest.raises(ValueError, match="cannot take new parameter groups"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
