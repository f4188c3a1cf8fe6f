"""Use a finished run: evaluate its exported model, or sample text from it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from adloco.checkpoint import CheckpointError
from adloco.config import ConfigError
from adloco.data import exported_tokenizer, load_corpus
from adloco.models.build import max_positions
from adloco.workers.tasks import Evaluation, build_task


def run_task(run_dir: Path) -> str:
    """The task a run trained (``lm`` when its config does not say, as before tasks existed)."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return "lm"
    return str(data.get("task", "lm")) if isinstance(data, dict) else "lm"


def load_final(run_dir: Path) -> tuple[torch.nn.Module, object]:
    """The exported model (``final/``) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
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
    auto = AutoModelForSequenceClassification if run_task(run_dir) == "classification" else AutoModelForCausalLM
    if not isinstance(description, dict):
        raise CheckpointError(f"'{description_path}' does not describe a tokenizer")
    try:
        model = auto.from_pretrained(final).float().eval()
    except Exception as error:  # transformers and safetensors raise many types for a damaged export
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise CheckpointError(f"the exported model in '{final}' cannot be loaded ({reason})") from None
    return model, exported_tokenizer(final, description)


@torch.no_grad()
def evaluate_final(run_dir: Path) -> Evaluation:
    """The exported model on the whole validation split: loss, tokens or samples covered, and (for
    classification runs) accuracy."""
    from adloco.config import resume_config

    config = resume_config(run_dir)
    model, tokenizer = load_final(run_dir)
    task = build_task(
        config.task,
        config.model,
        config.data,
        config.seed,
        tokenizer,
        lambda context: load_corpus(config.data, tokenizer, context),
        model_config=model.config,
    )
    return task.evaluate(model, [p.detach().clone() for p in model.parameters()])


def evaluate_run(run_dir: Path) -> tuple[float, int]:
    """Validation loss of the exported model over the whole validation split, and the tokens (or samples) it
    covers."""
    result = evaluate_final(run_dir)
    return result.loss, result.count


MAX_SAMPLE_TOKENS = 1_000_000


def sample(run_dir: Path, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """Continue ``prompt`` by ``tokens`` tokens, reading at most the model's context at a time."""
    return "".join(sample_stream(run_dir, prompt, tokens, temperature, top_k, seed))


@torch.no_grad()
def sample_stream(
    run_dir: Path, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int
) -> Iterator[str]:
    """``sample`` piece by piece: the prompt, then the text of each new token as soon as it decodes whole."""
    _check_sampling(tokens, temperature, top_k, seed)
    if run_task(run_dir) == "classification":
        raise ConfigError(f"'{run_dir}' is a classification run: its model labels texts and generates nothing")
    model, tokenizer = load_final(run_dir)
    context = max_positions(model.config) or 2**31  # architectures without a limit read the whole text
    ids = tokenizer.encode(prompt or "\n")  # an empty prompt starts at a line break
    generator = torch.Generator().manual_seed(seed)
    shown = tokenizer.decode(ids)
    yield shown
    for _ in range(tokens):
        logits = model(input_ids=ids[-context:][None], use_cache=False).logits[0, -1].float()
        ids = torch.cat([ids, torch.tensor([_next_token(logits, temperature, top_k, generator)])])
        text = tokenizer.decode(ids)
        # A character split over several tokens decodes as U+FFFD until its last byte arrives.
        if text.startswith(shown) and not text.endswith("\ufffd"):
            yield text[len(shown) :]
            shown = text
    text = tokenizer.decode(ids)
    yield text[len(shown) :] if text.startswith(shown) else ""


def _check_sampling(tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    if not 0 <= temperature < math.inf:  # also refuses NaN
        raise ConfigError(f"--temperature must be a number >= 0, got {temperature}")
    if not 0 <= tokens <= MAX_SAMPLE_TOKENS:
        raise ConfigError(f"--tokens must be between 0 and {MAX_SAMPLE_TOKENS:,}, got {tokens}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    if not -(2**63) <= seed < 2**64:  # what torch's generator accepts
        raise ConfigError(f"--seed must fit in 64 bits, got {seed}")


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
