"""Use a finished run: evaluate its exported model, or sample text from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from adloco.checkpoint import CheckpointError
from adloco.config import ConfigError
from adloco.data import Corpus, get_tokenizer, validation_blocks


def load_final(run_dir: Path) -> tuple[torch.nn.Module, object]:
    """The exported model (``final/``) and its tokenizer."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    final = run_dir / "final"
    if not (final / "config.json").exists():
        raise CheckpointError(f"'{run_dir}' has no exported model (final/config.json); has the run finished?")
    description_path = final / "adloco_tokenizer.json"
    try:
        description = json.loads(description_path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"'{description_path}' is missing or not JSON") from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(final).float().eval()
    return model, get_tokenizer(description.get("type", "byte"))


@torch.no_grad()
def evaluate_run(run_dir: Path) -> tuple[float, int]:
    """Validation loss of the exported model over the whole validation split, and the tokens it covers."""
    from adloco.training import evaluate, resume_config

    config = resume_config(run_dir)
    model, tokenizer = load_final(run_dir)
    context = int(model.config.max_position_embeddings)
    corpus = Corpus.load(config.data.dataset, tokenizer, config.data.val_fraction, context)
    blocks = validation_blocks(corpus.val, context)
    loss = evaluate(model, [p.detach().clone() for p in model.parameters()], blocks)
    return loss, int(blocks[:, 1:].numel())


@torch.no_grad()
def sample(run_dir: Path, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """Continue ``prompt`` by ``tokens`` tokens, reading at most the model's context at a time."""
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    model, tokenizer = load_final(run_dir)
    context = int(model.config.max_position_embeddings)
    ids = tokenizer.encode(prompt) if prompt else torch.tensor([ord("\n")])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        logits = model(input_ids=ids[-context:][None], use_cache=False).logits[0, -1].float()
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, -math.inf)
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        ids = torch.cat([ids, torch.tensor([next_id])])
    return tokenizer.decode(ids)
