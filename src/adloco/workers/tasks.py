"""Tasks: what a run trains. A task builds the model, gives each worker a deterministic, resumable sample
stream, computes the loss of a batch and evaluates θ. The algorithms only see gradients and parameters,
so every method trains every task.

- ``lm``: next-token prediction on a corpus (windows of context + 1 tokens, one shift).
- ``classification``: labelled texts (jsonl, csv) with a sequence-classification head; each sample is one
  row truncated or padded to the context, and evaluation also reports accuracy.

The token budget counts samples × context for both: a padded classification row costs its full context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from adloco.config import ConfigError, DataConfig, ModelConfig
from adloco.data import BUNDLED, DataError, Tokenizer, spread
from adloco.data.labelled import LabelledRows, LabelledSplit, SampleStream, label_names, read_labelled, split_rows
from adloco.models.build import ModelSpec, classification_loss, max_positions, next_token_loss, resolve_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

EVAL_BATCH = 64


STREAM_SEED_STRIDE = 1_000_003  # worker w of a run seeded s reads the stream seeded s · stride + w


class TaskSettings(Protocol):
    """What a run's task is built from (a run's config has them): its kind, the model and data sections, the seed."""

    @property
    def task(self) -> Literal["lm", "classification"]: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def seed(self) -> int: ...


class Stream(Protocol):
    """A worker's endless sample stream: batches of tensors with one row per sample, and a cursor."""

    def next_batch(self, size: int) -> tuple[torch.Tensor, ...]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Evaluation:
    """Mean validation loss; ``count`` is predicted tokens (lm) or samples (classification)."""

    loss: float
    count: int
    accuracy: float | None = None


@torch.no_grad()
def load_theta(model: torch.nn.Module, theta: Sequence[torch.Tensor]) -> None:
    for p, t in zip(model.parameters(), theta, strict=True):
        p.copy_(t)


@torch.no_grad()
def mean_next_token_loss(
    model: torch.nn.Module, theta: Sequence[torch.Tensor], blocks: torch.Tensor, batch: int = EVAL_BATCH
) -> float:
    """Mean next-token loss of θ over ``blocks`` (each of context + 1 tokens)."""
    load_theta(model, theta)
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch):
        chunk = blocks[start : start + batch]
        loss = next_token_loss(model, chunk[:, :-1], chunk[:, 1:])
        total += float(loss) * chunk.numel()
        count += chunk.numel()
    model.train()
    return total / count


class Task(ABC):
    """What a run trains: model, per-worker streams, loss, evaluation."""

    name: str

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed

    @property
    def context(self) -> int:
        return self.spec.context

    @property
    def vocab_size(self) -> int:
        return int(self.spec.config.vocab_size)

    def build_model(self, seed: int) -> PreTrainedModel:
        """The model for a trainer seeded ``seed``; from a checkpoint every trainer gets the same weights."""
        return self.spec.build(self.seed if self.spec.checkpoint is not None else seed)

    def build_skeleton(self) -> PreTrainedModel:
        """The model's parameters on the meta device (shapes and counts, no memory)."""
        return self.spec.skeleton()

    @abstractmethod
    def stream(self, seed: int, worker: int, workers: int) -> Stream:
        """Worker ``worker`` of ``workers``: its own deterministic sample stream."""

    def worker_stream(self, run_seed: int, worker: int, workers: int) -> Stream:
        """Worker ``worker``'s stream of a run seeded ``run_seed``, as ``adloco train``'s worker reads it."""
        return self.stream(run_seed * STREAM_SEED_STRIDE + worker, worker=worker, workers=workers)

    @abstractmethod
    def loss(self, model: torch.nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch as ``stream.next_batch`` returns it."""

    @abstractmethod
    def scratch_batch(self, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A random batch of ``size`` samples of the real shape (for the b_max probe)."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, theta: Sequence[torch.Tensor], limit: int | None = None) -> Evaluation:
        """θ on the validation split (``limit`` blocks or rows spread evenly across it; all with None)."""


class LanguageModelling(Task):
    name = "lm"

    def __init__(self, spec: ModelSpec, corpus: Any, seed: int) -> None:
        super().__init__(spec, seed)
        self.corpus = corpus
        self._blocks: dict[tuple[int | None, str], torch.Tensor] = {}
        largest = getattr(corpus, "largest_id", -1)
        if largest >= self.vocab_size:  # token files name their ids; a model without a row for one cannot train
            raise DataError(
                f"data '{corpus.where}' holds token id {largest:,}, at or above the model's vocabulary "
                f"({self.vocab_size:,})"
            )

    def stream(self, seed: int, worker: int, workers: int) -> Stream:
        return self.corpus.stream(self.context, seed, worker, workers)

    # The function itself, not a wrapper: worker groups recognise it as the loss their stacked forward computes.
    loss = staticmethod(next_token_loss)

    def scratch_batch(self, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(0, self.vocab_size, (size, self.context + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]

    def validation_blocks(self, limit: int | None, device: torch.device) -> torch.Tensor:
        key = (limit, str(device))
        if key not in self._blocks:
            self._blocks[key] = self.corpus.validation_blocks(self.context, limit).to(device)
        return self._blocks[key]

    def evaluate(self, model: torch.nn.Module, theta: Sequence[torch.Tensor], limit: int | None = None) -> Evaluation:
        blocks = self.validation_blocks(limit, next(model.parameters()).device)
        return Evaluation(loss=mean_next_token_loss(model, theta, blocks), count=int(blocks[:, 1:].numel()))


class Classification(Task):
    name = "classification"

    def __init__(self, spec: ModelSpec, train: LabelledSplit, val: LabelledSplit, labels: list[str], seed: int):
        super().__init__(spec, seed)
        self.train = train
        self.val = val
        self.labels = labels

    def stream(self, seed: int, worker: int, workers: int) -> Stream:
        return SampleStream(self.train, seed)

    def loss(self, model: torch.nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        return classification_loss(model, *batch)

    def scratch_batch(self, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(1, self.vocab_size, (size, self.context), device=device)
        labels = torch.randint(0, len(self.labels), (size,), device=device)
        return ids, torch.ones_like(ids), labels

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, theta: Sequence[torch.Tensor], limit: int | None = None) -> Evaluation:
        load_theta(model, theta)
        model.eval()
        device = next(model.parameters()).device
        chosen = spread(len(self.val), limit)
        rows = len(chosen)
        total, correct = 0.0, 0
        for start in range(0, rows, EVAL_BATCH):
            index = chosen[start : start + EVAL_BATCH]
            ids, mask, labels = (t.to(device) for t in self.val.batch(index))
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(-1) == labels).sum())
        model.train()
        return Evaluation(loss=total / rows, count=rows, accuracy=correct / rows)


def _pad_id(tokenizer: Tokenizer) -> int:
    # A Hugging Face tokenizer brings its own padding token; bytes pad with NUL (never in the texts). Without
    # one (GPT-2, a trained BPE) the end-of-text token stands in, as ordinary text never encodes to it; id 0
    # may be a real token, which BERT would then freeze as padding and decoders would skip when pooling.
    inner = getattr(tokenizer, "tokenizer", None)
    for pad in (getattr(inner, "pad_token_id", None), getattr(inner, "eos_token_id", None)):
        if isinstance(pad, int):
            return pad
    return 0


def _labelled_splits(data: DataConfig) -> tuple[LabelledRows, LabelledRows]:
    if data.dataset in BUNDLED:
        raise DataError(
            f"task=classification needs a labelled file in data.dataset (jsonl or csv with "
            f"'{data.text_field}' and '{data.label_field}'), not the bundled '{data.dataset}'"
        )
    rows = read_labelled(data.dataset, data.text_field, data.label_field)
    if data.val_dataset is not None:
        return rows, read_labelled(data.val_dataset, data.text_field, data.label_field)
    return split_rows(rows, data.val_fraction)


def classification_texts(data: DataConfig) -> Iterator[str]:
    """The training texts of a classification run's ``data``, read when a tokenizer has to be trained on them."""
    yield from _labelled_splits(data)[0].texts


def build_task(
    kind: Literal["lm", "classification"],
    model: ModelConfig,
    data: DataConfig,
    seed: int,
    tokenizer: Tokenizer,
    load_corpus: Callable[[int], Any] | None = None,
    model_config: PretrainedConfig | None = None,
) -> Task:
    """The task of ``kind`` (the config's ``task``), with the model the ``model`` section names and its data, its
    init and sample streams seeded by ``seed``.

    ``load_corpus(context)`` reads the language-modelling corpus once the context is known; a classification task
    reads the labelled rows ``data`` names. With ``model_config`` (an exported model's config) the model is not
    resolved again from presets or paths.
    """
    if kind == "lm":
        if model_config is None:
            spec = resolve_model(model.preset, model.path, model.context, tokenizer.vocab_size, "lm")
        else:
            spec = ModelSpec(model_config, "lm", model.context or max_positions(model_config) or 0)
        if load_corpus is None:
            raise ValueError("build_task: task=lm needs load_corpus")
        return LanguageModelling(spec, load_corpus(spec.context), seed)

    train_rows, val_rows = _labelled_splits(data)
    labels = label_names(train_rows, val_rows)
    pad_id = _pad_id(tokenizer)
    if model_config is None:
        spec = resolve_model(
            model.preset, model.path, model.context, tokenizer.vocab_size, "classification", labels, pad_id
        )
    else:
        exported = [model_config.id2label[i] for i in range(model_config.num_labels)]
        if exported != labels:
            raise ConfigError(f"the exported model's labels {exported} differ from the data's {labels}")
        spec = ModelSpec(model_config, "classification", model.context or max_positions(model_config) or 0)
    train = LabelledSplit.encode(train_rows, tokenizer, spec.context, pad_id, labels)
    val = LabelledSplit.encode(val_rows, tokenizer, spec.context, pad_id, labels)
    return Classification(spec, train, val, labels, seed)
