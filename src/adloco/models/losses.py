"""The training losses, apart from the model code (and its transformers import) so that the loop runs without it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def next_token_loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` given ``inputs``.

    The shift is done once, by the data (targets[t] = token t+1); the model is called without labels so
    that Hugging Face does not shift a second time.
    """
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def classification_loss(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of the labels; padding is masked out of attention."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return F.cross_entropy(logits.float(), labels)
