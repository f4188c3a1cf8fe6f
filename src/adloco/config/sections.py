"""The sections of the run configuration (``model``, ``data``, ``inner``, ``outer``, ``merge``, ``eval``,
``checkpoint``, ``streaming``, ``codec``, ``comm``, ``run``; ``batch`` in config/batch.py): each component takes its
own."""

from __future__ import annotations

import glob
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adloco.config.input import excerpt

HF_PREFIX = "hf:"  # names a Hugging Face dataset or tokenizer (hub name or local folder)
# The tier of a setting: the basic ones (a field's json_schema_extra=BASIC) are what most runs set and what
# `--print-config` shows; every other one is advanced (`--print-config=all`, the reference pages).
BASIC: dict[str, Any] = {"tier": "basic"}


def _absolute_if_local(value: str | None, keywords: tuple[str, ...] = ()) -> str | None:
    """A relative path that exists here, made absolute (``hf:`` kept); names and keywords stay as given.

    A run directory's config.yaml must name its data the same way from any working directory: ``adloco eval``,
    ``gradients`` and ``--resume`` may be started elsewhere than the training was.
    """
    if value is None or value in keywords:
        return value
    prefix = HF_PREFIX if value.startswith(HF_PREFIX) else ""
    target = value[len(prefix) :]
    if not target or os.path.isabs(target) or not (os.path.exists(target) or glob.glob(target)):
        return value  # a glob counts as local when it matches files (token shards)
    return prefix + os.path.abspath(target)


class _Section(BaseModel):
    # NaN/inf are never meaningful settings (an infinite timeout overflows timedelta, an infinite lr trains NaN).
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


# Shapes: (layers, heads, key/value heads, hidden, MLP width, context). `tiny` is the size of nanoGPT's CPU
# Shakespeare run (~0.9M parameters with bytes); `small` ~5M, `medium` ~20M; `llama-125m` is GPT-2 small's shape
# (12 layers, 12 heads, hidden 768, context 1024) as a LLaMA: 85M parameters outside the embeddings, as GPT-2
# 124M, and the MLP of LLaMA's 8/3 ratio (2048), ~135M with a 32k vocabulary (untied); `micro-llama-300m` has
# MicroLlama's shape (~240M with bytes, ~300M with a 32k vocabulary); `llama-1b` TinyLlama's (~0.97B with bytes,
# ~1.1B with a 32k vocabulary), a model to shard over several devices (shards=S).
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (4, 4, 4, 128, 384, 64),
    "small": (6, 8, 8, 256, 688, 128),
    "medium": (8, 8, 8, 448, 1280, 256),
    "llama-125m": (12, 12, 12, 768, 2048, 1024),
    "micro-llama-300m": (12, 16, 4, 1024, 5632, 2048),
    "llama-1b": (22, 32, 4, 2048, 5632, 2048),
}

# BERT encoders for sequence classification: (layers, heads, hidden, MLP width, context).
# `tiny-bert` ~0.45M parameters with bytes, `small-bert` ~3.3M.
BERT_PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny-bert": (2, 2, 128, 512, 128),
    "small-bert": (4, 4, 256, 1024, 256),
}


class ModelConfig(_Section):
    """The model: a preset built offline with random init, or a Hugging Face config or checkpoint
    (docs/models-and-tasks.md)."""

    preset: (
        Literal["tiny", "small", "medium", "llama-125m", "micro-llama-300m", "llama-1b", "tiny-bert", "small-bert"]
        | None
    ) = Field(
        None,
        description="Preset built offline with random init: LLaMA (tiny, small, medium, llama-125m, "
        "micro-llama-300m, llama-1b) or BERT (tiny-bert, small-bert; classification only). Default: tiny, or "
        "tiny-bert for task=classification.",
        json_schema_extra=BASIC,
    )
    path: str | None = Field(
        None,
        description="Instead of a preset: a Hugging Face config JSON file (random init) or a checkpoint "
        "directory (config.json + weights; every trainer starts from them).",
        json_schema_extra=BASIC,
    )
    context: int | None = Field(
        None,
        ge=2,
        description="Sequence length in tokens; default: the preset's context or the model's maximum.",
        json_schema_extra=BASIC,
    )

    @field_validator("path")
    @classmethod
    def _local_path_absolute(cls, value: str | None) -> str | None:
        return _absolute_if_local(value)


class DataConfig(_Section):
    """The corpus and its tokenizer: the bundled text, files, datasets or prepared token files (docs/data.md)."""

    dataset: str = Field(
        "tinyshakespeare",
        description="'tinyshakespeare' (bundled), a UTF-8 text file, a folder of *.txt/*.md files, a .jsonl or "
        ".parquet file, hf:NAME (Hugging Face datasets), or token files: a folder written by adloco prepare, "
        ".bin (nanoGPT, llm.c) or .npy files (a path or a glob). See docs/data.md.",
        json_schema_extra=BASIC,
    )
    tokenizer: str | None = Field(
        None,
        min_length=1,
        description="'byte' (vocabulary of 256), 'bpe' (byte-level BPE trained on the training split), a local "
        "Hugging Face tokenizer folder, or hf:NAME. Default: a prepared folder's own tokenizer, else 'byte'.",
        json_schema_extra=BASIC,
    )
    vocab_size: int = Field(512, ge=258, le=1_000_000, description="tokenizer=bpe: vocabulary size to train.")
    bpe_max_chars: int = Field(
        20_000_000, ge=1, description="tokenizer=bpe: train on at most this many leading training characters."
    )
    separator: str = Field("\n\n", description="Text placed between documents (files, rows) when they are joined.")
    hf_name: str | None = Field(None, description="Hugging Face dataset name or local folder (same as hf:NAME).")
    hf_config: str | None = Field(None, description="Hugging Face dataset configuration (subset) name.")
    hf_data_files: str | None = Field(None, description="data_files for datasets.load_dataset (e.g. with hf:json).")
    split: str = Field("train", description="Hugging Face dataset split to read.")
    streaming: bool = Field(
        False, description="Read documents lazily and pack them into windows (corpora larger than memory)."
    )
    val_documents: int = Field(128, ge=1, description="streaming: the first N documents are the validation split.")
    shuffle_buffer: int = Field(64, ge=1, description="streaming: windows each worker draws from at random (1: none).")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="Trailing fraction of the text used for validation.")
    text_field: str = Field("text", description="Field (jsonl key or csv column) holding the text of a row.")
    label_field: str = Field("label", description="task=classification: field holding a row's label.")
    val_dataset: str | None = Field(
        None,
        description="A separate validation file: labelled rows for task=classification, token files (.bin/.npy) "
        "for .bin/.npy training files (instead of their trailing val_fraction).",
    )
    verify: Literal["sha256", "size"] = Field(
        "sha256",
        description="Prepared token folders: check every shard's sha256 against the manifest before training "
        "(about 1.5 GB/s), or only its size.",
    )

    @field_validator("dataset", "tokenizer", "val_dataset", "hf_name", "hf_data_files")
    @classmethod
    def _local_paths_absolute(cls, value: str | None) -> str | None:
        return _absolute_if_local(value, keywords=("tinyshakespeare", "byte", "bpe"))

    def names_token_files(self) -> bool:
        """Whether ``dataset`` names token files (a prepared folder, .bin/.npy files or a glob of them)."""
        from adloco.data.token_files import names_token_files  # the one place config reads the data's formats

        return names_token_files(self.dataset)

    @model_validator(mode="after")
    def _token_files(self) -> DataConfig:
        """A prepared folder brings its tokenizer (another one named is refused); token files are never streamed."""
        from adloco.data.token_files import prepared_folder, run_tokenizer

        folder = prepared_folder(self.dataset)
        if folder is not None:
            self.tokenizer = run_tokenizer(folder, self.tokenizer)
        elif self.tokenizer is None:
            self.tokenizer = "byte"
        if self.streaming and self.names_token_files():
            raise ValueError("data.streaming: token files are read a window at a time already; leave it false")
        return self


class InnerConfig(_Section):
    """Each worker's own optimizer between exchanges (AdamW or Muon) and its learning-rate schedule."""

    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw, or muon: Muon on the hidden matrices and AdamW on embeddings, head, norms and biases "
        "(MuLoCo). See docs/optimizers.md.",
        json_schema_extra=BASIC,
    )
    lr: float = Field(
        1e-3,
        gt=0,
        description="Peak inner learning rate (Muon's too, RMS-matched to AdamW's).",
        json_schema_extra=BASIC,
    )
    min_lr: float = Field(1e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up, in inner steps.", json_schema_extra=BASIC)
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only; not norms/biases).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    clip: float | None = Field(1.0, gt=0, description="Gradient-norm clipping per worker; null disables it.")
    muon_lr: float | None = Field(None, gt=0, description="optimizer=muon: Muon's peak lr (default: inner.lr).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="optimizer=muon: Muon's (Nesterov) momentum.")


class OuterConfig(_Section):
    """The outer step that applies the averaged pseudo-gradient to θ at every round's end (docs/optimizers.md)."""

    optimizer: Literal["sgd", "adam"] = Field(
        "sgd",
        description="The outer step: 'sgd' (with momentum and Nesterov as set) or 'adam' (torch Adam on the "
        "pseudo-gradient, betas and eps below); the Python API takes any torch optimizer. See docs/optimizers.md.",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Outer learning rate, above 1 allowed (sgd: 1.0 for diloco/adloco; adam: 0.003).",
        json_schema_extra=BASIC,
    )
    momentum: float | None = Field(
        None, ge=0, lt=1, description="Outer SGD momentum (diloco/adloco: 0.5).", json_schema_extra=BASIC
    )
    nesterov: bool | None = Field(None, description="Nesterov outer momentum (diloco/adloco: true).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="optimizer=adam: its beta1, beta2 (each in [0, 1)).")
    eps: float = Field(1e-8, gt=0, description="optimizer=adam: its epsilon.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where θ, the outer optimizer's state and error-feedback residuals live: cpu (host memory, pinned "
        "where there is a GPU: a round copies Δ over and θ back), cuda (beside the workers), auto (adloco train: "
        "cpu; adloco.DiLoCo: cpu for models of 100 M parameters and more, else the model's device). See "
        "docs/gpu.md.",
    )
    overlap: Literal["none", "delayed", "eager"] = Field(
        "none",
        description="diloco/localsgd: exchange Δ during the next round; 'delayed' applies it a round late, "
        "'eager' also applies each worker's own fresh share at once (arXiv 2502.12996).",
    )


class MergeConfig(_Section):
    """How AdLoCo's trainers merge when there are several (``trainers`` > 1)."""

    policy: Literal["off", "b_req", "pairwise_reference"] | None = Field(
        None, description="Merge policy for multi-instance training; default 'b_req' for adloco."
    )
    every: int = Field(2, ge=1, description="Merge every this many rounds while more than one trainer is left.")
    group_size: int = Field(2, ge=2, description="How many trainers (smallest b_req) merge at once.")
    shared_init: bool = Field(
        True,
        description="Start every trainer from the same initial parameters (false: each from its own seed, which "
        "merges average poorly).",
    )


class EvalConfig(_Section):
    """Periodic and final evaluation on the validation split."""

    every: int = Field(20, ge=1, description="Evaluate θ every this many rounds.", json_schema_extra=BASIC)
    blocks: int = Field(
        64, ge=1, description="Validation blocks (task=classification: rows) for the periodic evaluation."
    )
    final_full: bool = Field(True, description="Evaluate the final θ on the whole validation split.")


class CheckpointConfig(_Section):
    """How often checkpoints are written, how many are kept and in which layout."""

    every: int = Field(
        20, ge=1, description="Write a checkpoint every this many rounds (and at the end).", json_schema_extra=BASIC
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        description="Also write one at the first round end after this many minutes since the last (under "
        "torchrun: by the first rank whose clock says so; the round's reports make every rank agree).",
    )
    keep: int = Field(2, ge=1, description="How many checkpoints to keep.")
    format: Literal["file", "sharded"] = Field(
        "file",
        description="file: one file that rank 0 writes (every rank's workers gathered to it); sharded: a folder "
        "where every rank writes its own workers with torch.distributed.checkpoint (needs a file system all ranks "
        "share). Either resumes on any number of ranks.",
    )


class SyncAutoConfig(_Section):
    """``sync_every=auto``: how H is chosen while training (docs/results/auto-sync.md)."""

    min: int = Field(5, ge=1, description="Smallest H auto may choose (streaming: a multiple of the fragments).")
    max: int = Field(200, ge=1, description="Largest H auto may choose (streaming: a multiple of the fragments).")
    start: int = Field(10, ge=1, description="H of the first rounds, until a round's costs are measured.")
    drift_steps: float = Field(
        400.0,
        gt=0,
        description="H_d, the drift scale in inner steps of 2 workers: H* = sqrt(H_d·c/t) for exchange seconds c per "
        "round and compute seconds t per step; larger means longer rounds on the same link. It grows as the inner lr "
        "decays and falls with more workers (workers_power).",
    )
    lr_stretch: float = Field(
        20.0,
        ge=1,
        description="How far H_d grows as the inner lr decays: the lr is read as no less than 1/lr_stretch of its "
        "peak, so H_d grows at most lr_stretch^lr_power times (H* by its square root). 1 keeps H_d fixed.",
    )
    lr_power: float = Field(
        1.0,
        ge=-2,
        le=4,
        description="How steeply H_d follows the lr: H_d · (peak lr/lr)^lr_power (the lr read as no less than "
        "1/lr_stretch of its peak). 1: H* grows as sqrt(peak/lr); 2: as peak/lr; 0: not at all; below 0 rounds "
        "shorten as the lr decays (docs/results/auto-sync.md compares them).",
    )
    workers_power: float = Field(
        1.0,
        ge=0,
        le=2,
        description="drift_steps is the drift scale of 2 workers; with M workers per trainer the rule uses "
        "drift_steps · (2/M)^workers_power: more workers, shorter rounds (docs/results/auto-sync.md). "
        "0: the same for any M.",
    )
    max_dispersion: float = Field(
        1.0,
        gt=0,
        description="Halve H when the workers' pseudo-gradient dispersion δ exceeds this (δ ≤ 1 for workers that "
        "share a direction up to noise).",
    )

    def bounds(self, fragments: int | None) -> tuple[int, int]:
        """The H auto may choose: ``min`` up and ``max`` down to multiples of streaming's ``fragments`` (each
        fragment syncs once per round)."""
        p = fragments or 1
        return -(-self.min // p) * p, max(p, self.max // p * p)

    def first(self, fragments: int | None) -> int:
        """H of the first round, before any costs are measured: ``start`` within the bounds."""
        low, high = self.bounds(fragments)
        p = fragments or 1
        return min(max(-(-self.start // p) * p, low), high)


class FaultToleranceConfig(_Section):
    """Fault-tolerant replicas on torchft (docs/fault-tolerance.md): a round goes on without a replica that died,
    and one that starts joins at the next round and heals from a live peer."""

    lighthouse: str | None = Field(
        None, description="Address of the torchft Lighthouse (http://HOST:PORT, see adloco lighthouse); set: "
        "this process is one replica of a fault-tolerant job."
    )  # fmt: skip
    replica: int | None = Field(None, ge=0, description="This replica's index, its worker id (0 … replicas−1).")
    replicas: int | None = Field(None, ge=1, description="The most replicas the job runs at once.")
    min_replicas: int = Field(1, ge=1, description="The fewest replicas a round commits with (else it is dropped).")
    host: str | None = Field(
        None, description="Address the peers reach this replica at to heal from it (default: this host's name)."
    )
    quorum_timeout_s: float = Field(
        300.0, gt=0, description="How long a round's start waits for its quorum: a joining replica waits for the "
        "peers' round to end, so at least one round's time."
    )  # fmt: skip
    exchange_timeout_s: float = Field(
        60.0, gt=0, description="A round's exchange, its commit and a heal's transfer; a replica silent for longer "
        "is dropped from the round."
    )  # fmt: skip
    quorum_retries: int = Field(
        3, ge=0, description="How often a round's start asks the Lighthouse again after losing it (a restarted "
        "Lighthouse), each after reconnecting for up to exchange_timeout_s."
    )  # fmt: skip
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="The exchange's process group: auto is NCCL for a model on a GPU, else gloo; gloo "
        "also serves a GPU model (its rows travel through host memory), as across machines without NCCL's network."
    )  # fmt: skip


class StreamingConfig(_Section):
    """Streaming DiLoCo: fragments, their overlap with computation and their mixing (docs/streaming-and-codecs.md)."""

    fragments: int | None = Field(
        None,
        ge=1,
        description="P: parameter fragments synced in turn (streaming: 2; other methods: 1).",
        json_schema_extra=BASIC,
    )
    assignment: Literal["strided", "sequential"] = Field(
        "strided", description="Blocks to fragments: strided (block l → l mod P) or contiguous runs."
    )
    shared: Literal["first", "own"] = Field(
        "first", description="Embeddings, final norm and head: join fragment 0, or form fragment 0 alone."
    )
    overlap: int | None = Field(
        None, ge=0, description="τ: inner steps between sending a fragment and applying its outer step (streaming: 1)."
    )
    alpha: float | None = Field(
        None, ge=0, le=1, description="α: fragment ← α·local + (1 − α)·outer after its sync (streaming: 0.5)."
    )


class CodecConfig(_Section):
    """How pseudo-gradients are encoded before they travel: quantized or sparse, with optional error feedback."""

    name: Literal["none", "fp32", "bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0", "topk"] = Field(
        "none",
        description="Encoding of exchanged pseudo-gradients; none sends float32 through an all-reduce path; topk "
        "sends the largest entries of each chunk (SparseLoCo, docs/streaming-and-codecs.md).",
        json_schema_extra=BASIC,
    )
    block_size: int = Field(32, ge=1, description="Elements sharing one power-of-two scale (int8, fp8, fp4).")
    error_feedback: bool | None = Field(
        None, description="Add each worker's quantization residual to its next exchange (default: on for topk only)."
    )
    feedback_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="β: the residual added back is β times what was dropped (SparseLoCo's accumulator; use with "
        "outer.momentum=0, as the decayed residual stands in for outer momentum).",
    )
    density: float = Field(0.01, gt=0, le=1, description="topk: the fraction of each chunk's entries sent.")
    value_bits: int = Field(2, description="topk: bits per sent value (2 to 8; 32 sends float32 values).")
    chunk_size: int = Field(4096, ge=2, le=2**16, description="topk: elements per chunk (the top k of each are sent).")

    @field_validator("value_bits")
    @classmethod
    def _value_bits(cls, value: int) -> int:
        if value != 32 and not 2 <= value <= 8:
            raise ValueError(f"must be 2 to 8, or 32, got {value}")
        return value

    @model_validator(mode="after")
    def _feedback_default(self) -> CodecConfig:
        if self.error_feedback is None:
            self.error_feedback = self.name == "topk"
        if self.feedback_decay != 1.0 and not (self.error_feedback and self.name != "none"):
            raise ValueError("feedback_decay: decays the error feedback, which this codec setting does not keep")
        return self


class CommConfig(_Section):
    """The transport between ranks: backend, timeouts and the reduction."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend under torchrun: NCCL with CUDA, else gloo."
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        le=365 * 86400,  # a timedelta cannot hold much more
        description="A collective waiting longer than this (a dead or hung rank) ends the job.",
    )
    reduce: Literal["gather", "allreduce"] = Field(
        "gather",
        description="gather: exact, placement-independent sums; allreduce: less traffic, backend summation order.",
    )


class RunConfig(_Section):
    """Where and how a run is written and reported: its directory, progress, plots and trackers."""

    root: str = Field("runs", description="Folder under which run directories are created.", json_schema_extra=BASIC)
    name: str | None = Field(
        None, description="Run directory name; default <model>_<dataset>_<UTC time>.", json_schema_extra=BASIC
    )

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, name: str | None) -> str | None:
        # A name with '/' or '..' would put the run outside run.root.
        if name is not None and (name in ("", ".", "..") or "/" in name or "\0" in name):
            raise ValueError(f"must be a plain folder name (not empty, '.' or '..'; no '/'), got {excerpt(name)}")
        return name

    progress: bool = Field(True, description="Show progress: a bar on a terminal, plain lines when piped.")
    progress_every_s: float = Field(
        10.0, gt=0, description="Seconds between plain progress lines (in train.log; on stderr when it is piped)."
    )
    save_final: bool = Field(True, description="Export the final model in Hugging Face format.")
    plots: bool = Field(True, description="Write PNG plots into the run directory at the end (adloco plot).")
    max_failed_rounds: int = Field(
        3, ge=1, description="Stop after this many rounds in a row in which a trainer had no finite worker."
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "clearml"]] = Field(
        ["tensorboard"],
        description="Experiment trackers that receive every metric: tensorboard (<run>/tensorboard), wandb, mlflow, "
        "clearml (pip extras); [] for none. See docs/tracking.md.",
        json_schema_extra=BASIC,
    )
    project: str = Field("adloco", min_length=1, description="Project / experiment name for wandb, mlflow, clearml.")
    mfu: bool | None = Field(
        None,
        description="Report model FLOPs utilisation in every round record and the progress line; default: where "
        "the device's peak is known (CUDA GPUs of the table in docs/gpu.md, or run.peak_tflops); true: refuse a run "
        "whose peak is unknown.",
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="The dense peak of one device, TFLOP/s, for MFU (a CPU, or a GPU not in the table)."
    )

    @model_validator(mode="before")
    @classmethod
    def _trackers_from_text(cls, data: Any) -> Any:
        # run.trackers=tensorboard,wandb on the command line arrives as one string
        if isinstance(data, dict) and isinstance(data.get("trackers"), str):
            data = {**data, "trackers": [t.strip() for t in data["trackers"].split(",") if t.strip()]}
        return data
