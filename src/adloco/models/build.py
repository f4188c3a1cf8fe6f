"""Models: LLaMA and BERT presets built offline, any Hugging Face config or checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from adloco.checkpoint import CheckpointError
from adloco.config import ConfigError
from adloco.config.sections import BERT_PRESETS, PRESETS
from adloco.models.losses import classification_loss, next_token_loss  # noqa: F401 - their home before

if TYPE_CHECKING:
    from transformers import BertConfig, LlamaConfig, PretrainedConfig, PreTrainedModel

# transformers is imported where a model or its config is made, not with this module: importing it costs seconds
# that a command which builds no model (and the test suite's collection) should not pay.

Head = Literal["lm", "classification"]


def preset_config(preset: str, vocab_size: int, context: int | None = None) -> LlamaConfig:
    """A LlamaConfig for a preset; ``context`` overrides the preset's sequence length."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset '{preset}' (choose from {', '.join(PRESETS)})")
    layers, heads, kv_heads, hidden, mlp, preset_context = PRESETS[preset]
    from transformers import LlamaConfig

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


def bert_preset_config(preset: str, vocab_size: int, context: int | None = None) -> BertConfig:
    """A BertConfig for a BERT preset (one token type: the byte tokenizer has no sentence pairs).

    No dropout: it would draw from torch's global generator, which checkpoints do not hold, so a resumed
    run would no longer be bit-identical (and these small encoders do not need it).
    """
    if preset not in BERT_PRESETS:
        raise ValueError(f"unknown BERT preset '{preset}' (choose from {', '.join(BERT_PRESETS)})")
    layers, heads, hidden, mlp, preset_context = BERT_PRESETS[preset]
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
        max_position_embeddings=context or preset_context,
        type_vocab_size=1,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence a model config allows (None for architectures without a limit)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_class(config: PretrainedConfig, head: Head) -> type[PreTrainedModel]:
    """The Hugging Face class with ``head`` on top of ``config``'s architecture."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if head == "lm" else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    try:
        return mapping[type(config)]
    except KeyError:
        kind = "causal language model" if head == "lm" else "sequence-classification model"
        raise ConfigError(f"model.path: model_type '{config.model_type}' has no {kind} class in transformers") from None


def _class_for(config: PretrainedConfig, head: Head) -> type[PreTrainedModel]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM if head == "lm" and type(config) is LlamaConfig else model_class(config, head)


def quiet_transformers() -> None:
    """transformers says only its errors (its warnings about our own offline configs are noise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def no_progress_bar() -> None:
    """No transformers progress bars (loading and saving a model a run knows the size of)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_model(config: PretrainedConfig, seed: int, head: Head = "lm") -> PreTrainedModel:
    """A randomly initialised model with ``head``; the same seed gives the same parameters."""
    quiet_transformers()
    cls = _class_for(config, head)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.float()


def read_config_file(path: Path) -> PretrainedConfig:
    """A Hugging Face config JSON file (its ``model_type`` picks the architecture)."""
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"model.path: '{path}' cannot be read: {error}") from None
    except ValueError as error:
        raise ConfigError(f"model.path: '{path}' is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path: '{path}' must hold a JSON object, not {type(data).__name__}")
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError(f"model.path: '{path}' has no model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as error:
        if "Unrecognized model identifier" in str(error):
            raise ConfigError(f"model.path: unknown model_type '{model_type}' in '{path}'") from None
        raise ConfigError(f"model.path: '{path}' is not a valid {model_type} config ({error})") from None
    except TypeError as error:
        raise ConfigError(f"model.path: '{path}' is not a valid {model_type} config ({error})") from None


@dataclass
class ModelSpec:
    """How to build every trainer's model: a config with random init, or a checkpoint's weights."""

    config: PretrainedConfig
    head: Head
    context: int
    checkpoint: Path | None = None
    label: str = "model"

    def skeleton(self) -> PreTrainedModel:
        """The model's parameters on the meta device: counted and their shapes read without allocating them."""
        quiet_transformers()
        with torch.device("meta"):
            return _class_for(self.config, self.head)(self.config)

    def build(self, seed: int) -> PreTrainedModel:
        """The model for ``seed``; a checkpoint gives the same weights whatever the seed (except new heads)."""
        if self.checkpoint is None:
            return build_model(self.config, seed, self.head)
        cls = model_class(self.config, self.head)
        quiet_transformers()
        no_progress_bar()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # a head the checkpoint lacks starts from this seed
                model = cls.from_pretrained(
                    self.checkpoint, config=self.config, dtype=torch.float32, ignore_mismatched_sizes=True
                )
        except Exception as error:  # safetensors, pickle and HF raise many kinds; all mean unreadable weights
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise CheckpointError(f"model.path: cannot load the weights in '{self.checkpoint}' ({first})") from None
        return model.float()


def _causal(config: PretrainedConfig) -> PretrainedConfig:
    # Encoder architectures that can also decode (BERT, RoBERTa, ...) attend both ways unless told otherwise.
    if getattr(config, "is_decoder", None) is False and not config.is_encoder_decoder:
        config.is_decoder = True
    return config


def resolve_model(
    preset: str | None,
    path: str | None,
    context: int | None,
    vocab_size: int,
    head: Head = "lm",
    labels: list[str] | None = None,
    pad_token_id: int = 0,
) -> ModelSpec:
    """The model a run trains: a preset, a config JSON file or a checkpoint directory.

    The vocabulary follows the tokenizer (a config file is resized to it; a checkpoint must match it), and
    ``context`` must fit the model's positions. A classification head gets one output per label.
    """
    checkpoint = None
    if path is None:
        name = preset or ("tiny" if head == "lm" else "tiny-bert")
        if name in BERT_PRESETS:
            if head == "lm":
                raise ConfigError(f"model.preset: {name} is an encoder for task=classification, not a language model")
            config: PretrainedConfig = bert_preset_config(name, vocab_size, context)
        else:
            config = preset_config(name, vocab_size, context)
        label = name
    else:
        source = Path(path)
        if not source.exists():
            raise ConfigError(f"model.path: '{path}' does not exist")
        if source.is_dir():
            if not (source / "config.json").is_file():
                raise ConfigError(f"model.path: directory '{path}' has no config.json")
            config = read_config_file(source / "config.json")
            if config.vocab_size != vocab_size:
                raise ConfigError(
                    f"model.path: the checkpoint's vocabulary has {config.vocab_size} tokens but the tokenizer "
                    f"has {vocab_size}"
                )
            checkpoint = source
        else:
            config = read_config_file(source)
            config.vocab_size = vocab_size
        label = source.name if source.is_dir() else source.stem
        model_class(config, head)  # fail now, not when the first trainer is built
        if head == "lm":
            _causal(config)
    limit = max_positions(config)
    if context is None:
        if limit is None:
            raise ConfigError(f"model.context: '{label}' sets no maximum length; give model.context")
        context = limit
    elif limit is not None and context > limit:
        raise ConfigError(f"model.context: {context} exceeds the model's {limit} positions")
    if head == "classification":
        assert labels is not None and len(labels) >= 2
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
        config.pad_token_id = pad_token_id
    return ModelSpec(config=config, head=head, context=int(context), checkpoint=checkpoint, label=label)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token_of(model: torch.nn.Module, context: int) -> float:
    """Training FLOPs per token (``adloco.algorithms.flops``): the parameters outside embedding lookups (an output
    head tied to the input embedding is a product and counts), the model's layers and hidden size."""
    from adloco.algorithms.flops import flops_per_token

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = None if head is None else head.weight
    lookups = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lookups.pop(id(head_weight), None)
    parameters = sum(p.numel() for p in model.parameters()) - sum(lookups.values())
    config = model.config
    return flops_per_token(parameters, int(config.num_hidden_layers), int(config.hidden_size), context)
