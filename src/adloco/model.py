"""LLaMA presets built offline with ``transformers``, and the next-token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

# Shapes: (layers, heads, key/value heads, hidden, MLP width, context). `tiny` is the size of nanoGPT's CPU
# Shakespeare run (~0.9M parameters with bytes); `small` ~5M, `medium` ~20M; `micro-llama-300m` has
# MicroLlama's shape (~240M with bytes, ~300M with a 32k vocabulary).
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (4, 4, 4, 128, 384, 64),
    "small": (6, 8, 8, 256, 688, 128),
    "medium": (8, 8, 8, 448, 1280, 256),
    "micro-llama-300m": (12, 16, 4, 1024, 5632, 2048),
}


def preset_config(preset: str, vocab_size: int, context: int | None = None) -> LlamaConfig:
    """A LlamaConfig for a preset; ``context`` overrides the preset's sequence length."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset '{preset}' (choose from {', '.join(PRESETS)})")
    layers, heads, kv_heads, hidden, mlp, preset_context = PRESETS[preset]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context or preset_context,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(config: LlamaConfig, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM; the same seed gives the same parameters."""
    hf_logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def next_token_loss(model: PreTrainedModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` given ``inputs``.

    The shift is done once, by the data (targets[t] = token t+1); the model is called without labels so
    that Hugging Face does not shift a second time.
    """
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
