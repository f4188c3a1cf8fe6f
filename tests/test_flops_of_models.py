"""The FLOPs of the models a run trains: the presets' counts, lookups left out, a tied head counted."""

import torch

from adloco.models.build import flops_per_token_of, preset_config
from adloco.models.precision import compute_dtype, peak_flops


def test_llama_125m_has_gpt2_smalls_shape_and_its_flops():
    from transformers import LlamaForCausalLM

    config = preset_config("llama-125m", 32768)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layer = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768  # attention, MLP, two norms
    outside_embedding = 12 * layer + 768 + 768 * 32768  # final norm and the output head
    assert 12 * layer == 84_953_088  # GPT-2 small's 85 M outside the embeddings
    assert config.max_position_embeddings == 1024
    assert flops_per_token_of(model, 1024) == 6 * outside_embedding + 12 * 12 * 768 * 1024


def test_a_head_tied_to_the_embedding_counts_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # the shared matrix once
    assert flops_per_token_of(model, 8) == 6 * total + 12 * 1 * 16 * 8


def test_peaks_are_known_for_gpus_only():
    assert peak_flops(torch.device("cpu"), "bf16", True) is None
    assert compute_dtype("fp32", True) == "tf32" and compute_dtype("fp32", False) == "fp32"
    assert compute_dtype("bf16", False) == "bf16"
