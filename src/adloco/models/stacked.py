"""Several LLaMA workers of one shape as one computation: each parameter stacked along a leading worker dimension.

One forward and backward serve W workers: every linear layer is a batched matmul over the worker dimension, and
attention runs over (worker × sample) rows. Each worker's loss and gradient depend only on its own slice, so the
numbers are those of W separate models up to float rounding (the kernels differ; see docs/results/throughput.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from adloco.models.losses import next_token_loss

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def unsupported_reason(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor]) -> str | None:
    """Why ``model`` cannot run stacked (None when it can): the stacked forward knows plain LLaMA decoders only."""
    if loss_fn is not next_token_loss:
        return "the task's loss is not next-token prediction"
    from transformers import LlamaForCausalLM  # transformers loads where a model is built, not on import

    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a LLaMA causal LM"
    config = model.config
    checks = {
        "its activation is not SiLU": config.hidden_act != "silu",
        "its projections have biases": config.attention_bias or config.mlp_bias,
        "its RoPE is scaled": (config.rope_parameters or {}).get("rope_type", "default") != "default",
        "it ties input and output embeddings": config.tie_word_embeddings,
        "its embeddings have a padding index": config.pad_token_id is not None,
        "it has attention dropout": config.attention_dropout != 0.0,
    }
    return next((reason for reason, failed in checks.items() if failed), None)


def _head_dim(config: LlamaConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class StackedLlama:
    """The forward of W LLaMA decoders from stacked parameters, in the order of ``model.parameters()``."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        reason = unsupported_reason(model, next_token_loss)
        if reason is not None:
            raise ValueError(f"cannot stack this model: {reason}")
        config = model.config
        self.config = config
        self.head_dim = _head_dim(config)
        index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self.embed = index["model.embed_tokens.weight"]
        self.layers = [
            {part: index[f"model.layers.{layer}.{part}.weight"] for part in _LAYER_PARTS}
            for layer in range(config.num_hidden_layers)
        ]
        self.norm = index["model.norm.weight"]
        self.lm_head = index["lm_head.weight"]
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self._rotary: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def losses(self, params: Sequence[torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each worker's mean next-token cross-entropy: ``inputs``/``targets`` are [W, samples, context]."""
        workers, samples, context = inputs.shape
        vocab = params[self.embed].size(1)
        offsets = (torch.arange(workers, device=inputs.device) * vocab).view(workers, 1, 1)
        table = params[self.embed].reshape(workers * vocab, -1)
        hidden = F.embedding(inputs + offsets, table).view(workers, samples * context, -1)
        cos, sin = self._rotary_for(context, hidden)
        for layer in self.layers:
            hidden = hidden + self._attention(
                params, layer, self._rms(params[layer["input_layernorm"]], hidden), samples, cos, sin
            )
            normed = self._rms(params[layer["post_attention_layernorm"]], hidden)
            gate = F.silu(_linear(normed, params[layer["mlp.gate_proj"]]))
            hidden = hidden + _linear(
                gate * _linear(normed, params[layer["mlp.up_proj"]]), params[layer["mlp.down_proj"]]
            )
        logits = _linear(self._rms(params[self.norm], hidden), params[self.lm_head])
        # One mean per worker, reduced as next_token_loss reduces one model's tokens.
        return torch.stack([F.cross_entropy(logits[k].float(), targets[k].reshape(-1)) for k in range(workers)])

    def _rms(self, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight.unsqueeze(1) * hidden.to(dtype)

    def _attention(
        self,
        params: Sequence[torch.Tensor],
        layer: dict[str, int],
        hidden: torch.Tensor,
        samples: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        workers = hidden.size(0)
        context = hidden.size(1) // samples

        def heads(part: str) -> torch.Tensor:
            projected = _linear(hidden, params[layer[part]])
            return projected.view(workers * samples, context, -1, self.head_dim).transpose(1, 2)

        query, key, value = heads("self_attn.q_proj"), heads("self_attn.k_proj"), heads("self_attn.v_proj")
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        grouped = self.config.num_key_value_heads != self.config.num_attention_heads
        attended = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.head_dim**-0.5, enable_gqa=grouped
        )
        attended = attended.transpose(1, 2).reshape(workers, samples * context, -1)
        return _linear(attended, params[layer["self_attn.o_proj"]])

    def _rotary_for(self, context: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (context, like.device, like.dtype)
        if key not in self._rotary:
            positions = torch.arange(context, device=like.device, dtype=torch.float)
            freqs = positions[:, None] * self.inv_freq.to(like.device)[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            self._rotary[key] = (angles.cos().to(like.dtype), angles.sin().to(like.dtype))
        return self._rotary[key]


def _linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[W, N, in] × [W, out, in] → [W, N, out]: each worker's rows through its own weight."""
    return torch.bmm(hidden, weight.transpose(1, 2))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
