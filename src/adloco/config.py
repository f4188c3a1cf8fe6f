"""One validated configuration object for a run, loaded from YAML plus ``key.sub=value`` overrides."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from adloco.algorithms.schedules import validate_schedule
from adloco.config_input import YAMLInputError, apply_overrides, excerpt, load_yaml
from adloco.errors import CheckpointError, ConfigError

__all__ = ["ConfigError", "TrainConfig", "apply_overrides", "build_config", "load_config", "resume_config"]

HF_PREFIX = "hf:"  # names a Hugging Face dataset or tokenizer (hub name or local folder)


def _absolute_if_local(value: str | None, keywords: tuple[str, ...] = ()) -> str | None:
    """A relative path that exists here, made absolute (``hf:`` kept); names and keywords stay as given.

    A run directory's config.yaml must name its data the same way from any working directory: ``adloco eval``,
    ``gradients`` and ``--resume`` may be started elsewhere than the training was.
    """
    if value is None or value in keywords:
        return value
    prefix = HF_PREFIX if value.startswith(HF_PREFIX) else ""
    target = value[len(prefix) :]
    if not target or os.path.isabs(target) or not os.path.exists(target):
        return value
    return prefix + os.path.abspath(target)


class _Section(BaseModel):
    # NaN/inf are never meaningful settings (an infinite timeout overflows timedelta, an infinite lr trains NaN).
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "medium", "micro-llama-300m", "llama-1b", "tiny-bert", "small-bert"] | None = (
        Field(
            None,
            description="Preset built offline with random init: LLaMA (tiny, small, medium, micro-llama-300m, "
            "llama-1b) or BERT (tiny-bert, small-bert; classification only). Default: tiny, or tiny-bert for "
            "task=classification.",
        )
    )
    path: str | None = Field(
        None,
        description="Instead of a preset: a Hugging Face config JSON file (random init) or a checkpoint "
        "directory (config.json + weights; every trainer starts from them).",
    )
    context: int | None = Field(
        None, ge=2, description="Sequence length in tokens; default: the preset's context or the model's maximum."
    )

    @field_validator("path")
    @classmethod
    def _local_path_absolute(cls, value: str | None) -> str | None:
        return _absolute_if_local(value)


class DataConfig(_Section):
    dataset: str = Field(
        "tinyshakespeare",
        description="'tinyshakespeare' (bundled), a UTF-8 text file, a folder of *.txt/*.md files, a .jsonl or "
        ".parquet file, or hf:NAME (Hugging Face datasets). See docs/data.md.",
    )
    tokenizer: str = Field(
        "byte",
        min_length=1,
        description="'byte' (vocabulary of 256), 'bpe' (byte-level BPE trained on the training split), a local "
        "Hugging Face tokenizer folder, or hf:NAME.",
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
        None, description="task=classification: a separate labelled validation file instead of val_fraction."
    )

    @field_validator("dataset", "tokenizer", "val_dataset", "hf_name", "hf_data_files")
    @classmethod
    def _local_paths_absolute(cls, value: str | None) -> str | None:
        return _absolute_if_local(value, keywords=("tinyshakespeare", "byte", "bpe"))


class InnerConfig(_Section):
    lr: float = Field(1e-3, gt=0, description="Peak inner (AdamW) learning rate.")
    min_lr: float = Field(1e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up, in inner steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only; not norms/biases).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    clip: float | None = Field(1.0, gt=0, description="Gradient-norm clipping per worker; null disables it.")


class OuterConfig(_Section):
    lr: float | None = Field(None, gt=0, description="Outer SGD learning rate (diloco/adloco: 1.0).")
    momentum: float | None = Field(None, ge=0, lt=1, description="Outer momentum (diloco/adloco: 0.5).")
    nesterov: bool | None = Field(None, description="Nesterov outer momentum (diloco/adloco: true).")
    overlap: Literal["none", "delayed", "eager"] = Field(
        "none",
        description="diloco/localsgd: exchange Δ during the next round; 'delayed' applies it a round late, "
        "'eager' also applies each worker's own fresh share at once (arXiv 2502.12996).",
    )


StepSeconds = tuple[float, float] | list[tuple[float, float]]  # one [a, c] for every worker, or one per worker


class BatchConfig(_Section):
    size: int = Field(3, ge=1, description="Per-worker batch b (samples per inner step) at the start.")
    test: Literal["constant", "norm", "inner_product"] | None = Field(
        None, description="Batch-size test; default 'norm' for adloco, 'constant' otherwise."
    )
    controller: Literal["time", "test"] | None = Field(
        None,
        description="How b changes: 'time' picks the batch that reaches a loss soonest on the measured step and "
        "round times (default for adloco); 'test' follows batch.test (default otherwise). See docs/batch-size.md.",
    )
    patience: int = Field(
        2, ge=1, description="controller=time: decisions in a row that point the same way before b moves."
    )
    max_growth: float = Field(2.0, gt=1, description="controller=time: b grows at most this factor per decision.")
    min_steps_left: int = Field(
        50, ge=1, description="controller=time: b grows only while the remaining budget holds this many inner steps."
    )
    step_seconds: StepSeconds | None = Field(
        None,
        description="controller=time or shares=speed: pin a worker's step time t(b) = a + c·b as [a, c] seconds, "
        "one pair for all workers or a list with one per worker (decisions and shares then reproduce exactly, with "
        "batch.round_seconds); null: time it and follow the real steps.",
    )
    keep_round_time: bool = Field(
        False,
        description="As b grows, take fewer inner steps per round so a round reads about as many samples as at "
        "the start: H_r = max(1, round(H·samples at the start / samples now)); not with method=streaming.",
    )
    shares: Literal["equal", "speed"] = Field(
        "equal",
        description="How a trainer's M·b samples per step are split over its workers: 'equal' (b each) or 'speed' "
        "(in proportion to each worker's measured speed, pseudo-gradients averaged with sample weights).",
    )
    round_seconds: float | None = Field(
        None, ge=0, description="controller=time: pin a round's exchange and waiting time; null: measure it."
    )

    @field_validator("step_seconds", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        # Said here in the setting's own words: pydantic would name the union member it tried last.
        def pair(item: Any) -> bool:
            return (
                isinstance(item, list | tuple) and len(item) == 2 and not any(isinstance(x, list | tuple) for x in item)
            )

        if value is None or pair(value) or (isinstance(value, list | tuple) and value and all(pair(x) for x in value)):
            return value
        raise ValueError("give [a, c] or a list of [a, c] pairs, one per worker")

    @field_validator("step_seconds")
    @classmethod
    def _positive_cost(cls, value: StepSeconds | None) -> StepSeconds | None:
        pairs = [] if value is None else value if isinstance(value, list) else [value]
        if isinstance(value, list) and not value:
            raise ValueError("give [a, c] or a list of [a, c] pairs, one per worker")
        for a, c in pairs:
            if min(a, c) < 0 or max(a, c) <= 0 or not (math.isfinite(a) and math.isfinite(c)):
                raise ValueError("give [a, c] with a, c >= 0, finite, and not both 0")
        return value

    estimator: Literal["microbatch", "cross_worker"] = Field(
        "microbatch", description="Gradient-variance estimator for the batch test."
    )
    eta: float = Field(0.8, gt=0, description="Norm-test tolerance η.")
    theta: float = Field(0.8, gt=0, description="Augmented inner-product test: ϑ (inner-product part).")
    nu: float = Field(1.0, gt=0, description="Augmented inner-product test: ν (orthogonal part).")
    ema: float = Field(
        0.5, ge=0, lt=1, description="EMA smoothing of the test statistics across rounds (0: each round alone)."
    )
    groups: int = Field(4, ge=2, description="k_max: groups the first step of a round is split into.")
    b_min: int = Field(1, ge=1, description="Smallest per-worker batch the test may ask for.")
    b_cap: int = Field(64, ge=1, description="Largest per-worker batch the test may ask for.")
    allow_shrink: bool = Field(False, description="Let the test lower b (default: b never decreases).")
    test_every: int = Field(1, ge=1, description="Run the batch test every this many rounds.")
    switch_factor: float = Field(2.0, ge=1, description="Switch mode n: accumulate only when b_req > n·b_max.")
    lr_scaling: Literal["none", "sqrt", "linear"] = Field(
        "sqrt",
        description="When a trainer's b changes, scale its inner lr by (b/batch.size)^α: none α=0, sqrt α=0.5, "
        "linear α=1 (see docs/batch-size.md).",
    )
    lr_scale_max: float = Field(
        4.0, ge=1, description="The inner lr is scaled by at most this factor (and at least its inverse)."
    )
    beta2_scaling: bool = Field(
        True, description="When b changes, AdamW β2 → β2^(b/batch.size): the same memory in samples."
    )
    b_max: int | None = Field(
        None,
        ge=1,
        description="Largest micro-batch per worker; null: probe it under the memory budget, or b_cap without one.",
    )
    memory_fraction: float = Field(
        0.9, gt=0, le=1, description="b_max probe on CUDA: share of the device memory a step may peak at."
    )
    memory_budget_mb: float | None = Field(
        None, gt=0, description="b_max probe on CPU: peak process memory (MiB) a step may reach; null: no probe."
    )


class MergeConfig(_Section):
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
    every: int = Field(20, ge=1, description="Evaluate θ every this many rounds.")
    blocks: int = Field(
        64, ge=1, description="Validation blocks (task=classification: rows) for the periodic evaluation."
    )
    final_full: bool = Field(True, description="Evaluate the final θ on the whole validation split.")


class CheckpointConfig(_Section):
    every: int = Field(20, ge=1, description="Write a checkpoint every this many rounds (and at the end).")
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


class StreamingConfig(_Section):
    fragments: int | None = Field(
        None, ge=1, description="P: parameter fragments synced in turn (streaming: 2; other methods: 1)."
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
    name: Literal["none", "fp32", "bf16", "fp16", "int8", "fp8-e4m3", "fp4-e2m1", "fp4-e3m0"] = Field(
        "none", description="Encoding of exchanged pseudo-gradients; none sends float32 through an all-reduce path."
    )
    block_size: int = Field(32, ge=1, description="Elements sharing one power-of-two scale (int8, fp8, fp4).")
    error_feedback: bool = Field(False, description="Add each worker's quantization residual to its next exchange.")


class CommConfig(_Section):
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
    root: str = Field("runs", description="Folder under which run directories are created.")
    name: str | None = Field(None, description="Run directory name; default <model>_<dataset>_<UTC time>.")

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
    )
    project: str = Field("adloco", min_length=1, description="Project / experiment name for wandb, mlflow, clearml.")

    @model_validator(mode="before")
    @classmethod
    def _trackers_from_text(cls, data: Any) -> Any:
        # run.trackers=tensorboard,wandb on the command line arrives as one string
        if isinstance(data, dict) and isinstance(data.get("trackers"), str):
            data = {**data, "trackers": [t.strip() for t in data["trackers"].split(",") if t.strip()]}
        return data


Method = Literal["ddp", "localsgd", "diloco", "adloco", "streaming"]

# What each method means when the user leaves a key unset.
_BASELINE = {"sync_every": 10, "workers": 4, "trainers": 1, "test": "constant", "merge": "off"}
_METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "ddp": {**_BASELINE, "outer": (1.0, 0.0, False)},
    "localsgd": {**_BASELINE, "outer": (1.0, 0.0, False)},
    "diloco": {**_BASELINE, "outer": (1.0, 0.5, True)},
    "streaming": {**_BASELINE, "outer": (1.0, 0.5, True)},
    # One trainer of 4 workers: on the anchor task Multi-Instance Training (trainers=4 workers=1) ended 1.8-3.1 %
    # above DiLoCo even from a shared init, one trainer 0.4-1.1 % (docs/batch-size.md); trainers=K merges.
    "adloco": {**_BASELINE, "outer": (1.0, 0.5, True), "test": "norm", "merge": "b_req"},
}


class TrainConfig(BaseModel):
    """Everything a run needs; every key is documented in docs/configuration.md."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: Method = Field("diloco", description="ddp | localsgd | diloco | streaming | adloco.")
    task: Literal["lm", "classification"] = Field(
        "lm",
        description="lm: next-token prediction on text; classification: labelled texts (jsonl, csv, tsv, parquet); "
        "see docs/models-and-tasks.md.",
    )
    workers: int | None = Field(None, ge=1, description="Workers per trainer at the start (M); default 4.")
    trainers: int | None = Field(
        None, ge=1, description="Model instances (K) of Multi-Instance Training, merged as they go; default 1."
    )
    sync_every: int | None = Field(
        None,
        ge=1,
        description="H: inner steps per round (ddp averages gradients every step; H only sets its round length).",
    )
    total_tokens: int = Field(1_536_000, ge=1, description="Training tokens over all workers and trainers.")
    # Bounded so that every seed derived from it (seed × stride + worker) fits torch's 64-bit generators.
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for init and data order; same seed ⇒ same numbers.")
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads (default: torch's choice).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where workers train: cuda when available (one GPU per rank), else cpu."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Inner steps' forward pass: fp32, or bf16 or fp16 under autocast (weights, optimizer state, "
        "outer state, exchanges and evaluation stay float32; runs on CPU and CUDA). fp16 scales each worker's loss "
        "dynamically: an overflowing step is computed again on the same samples with half the scale.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each training step's forward and backward (a worker group's stacked model, or "
        "each worker's loss). The first steps compile (seconds to minutes); needs a C++ compiler on CPU, Triton "
        "on CUDA, checked at start.",
    )
    tf32: bool = Field(
        True,
        description="CUDA only: float32 matmuls and convolutions on TF32 tensor cores (10-bit-mantissa products, "
        "float32 accumulation). No effect on CPU.",
    )
    batched_workers: bool = Field(
        True,
        description="Run the workers a rank hosts as one stacked computation (one forward, backward and AdamW "
        "update for all) where they can: LLaMA language models, same micro-batches. Each worker's numbers equal "
        "the one-by-one path's within float rounding (docs/throughput.md); false: one worker at a time.",
    )
    slots_per_rank: int | None = Field(
        None, ge=1, description="Worker slots per rank under torchrun; default: all workers spread evenly."
    )
    shards: int = Field(
        1,
        ge=1,
        description="Ranks per worker under torchrun: each worker's model, gradients and AdamW state are sharded "
        "over this many ranks with FSDP2, and the round exchange runs shard by shard among the workers (HSDP). "
        "World size = workers ÷ slots_per_rank × shards; checkpoints are then sharded (docs/distributed.md).",
    )
    elastic: bool = Field(
        False,
        description="Let the worker count change when the run resumes (one trainer, in-memory corpus). Under "
        "torchrun the job has world size × slots_per_rank (default 1) workers, so a restart with fewer or more "
        "ranks (--nnodes=MIN:MAX) resizes it; in one process `workers` may change on resume. Retired workers' data "
        "streams are kept for their return; new workers start from θ with fresh inner state (docs/distributed.md).",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    codec: CodecConfig = Field(default_factory=CodecConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    _given: frozenset[str] = PrivateAttr(default=frozenset())

    def __eq__(self, other: object) -> bool:
        # The keys the input named (given_keys) say how a config was written, not what it is.
        return type(other) is type(self) and self.__dict__ == other.__dict__

    @property
    def given_keys(self) -> frozenset[str]:
        """The top-level keys the input set (before method defaults filled the rest in)."""
        return self._given

    @model_validator(mode="after")
    def _resolve_method_defaults(self) -> TrainConfig:
        self._given = frozenset(self.model_fields_set)
        defaults = _METHOD_DEFAULTS[self.method]
        self._resolve_model()
        if self.sync_every is None:
            self.sync_every = defaults["sync_every"]
        if self.trainers is None:
            self.trainers = defaults["trainers"]
        if self.workers is None:
            self.workers = defaults["workers"]
        lr, momentum, nesterov = defaults["outer"]
        if self.method in ("ddp", "localsgd"):
            # These baselines are defined by their outer step; a different one would be another method.
            for key, value, fixed in (("lr", self.outer.lr, lr), ("momentum", self.outer.momentum, momentum)):
                if value is not None and value != fixed:
                    raise ValueError(f"outer.{key}: {self.method} fixes it to {fixed}; use method=diloco to tune it")
        self.outer.lr = lr if self.outer.lr is None else self.outer.lr
        self.outer.momentum = momentum if self.outer.momentum is None else self.outer.momentum
        self.outer.nesterov = nesterov if self.outer.nesterov is None else self.outer.nesterov
        if self.outer.nesterov and self.outer.momentum == 0:
            self.outer.nesterov = False
        if self.batch.test is None:
            self.batch.test = defaults["test"]
        if self.batch.controller is None:
            self.batch.controller = "time" if self.method == "adloco" else "test"
        if self.merge.policy is None:
            self.merge.policy = defaults["merge"] if self.trainers > 1 else "off"
        if self.method == "ddp" and (self.batch.test != "constant" or self.batch.controller != "test"):
            raise ValueError("batch.test: ddp runs with a constant batch")
        streaming = self.streaming
        if self.method == "streaming":
            streaming.fragments = 2 if streaming.fragments is None else streaming.fragments
            streaming.overlap = 1 if streaming.overlap is None else streaming.overlap
            streaming.alpha = 0.5 if streaming.alpha is None else streaming.alpha
            validate_schedule(self.sync_every, streaming.fragments, streaming.overlap)
        else:
            for key, value in (("fragments", streaming.fragments), ("overlap", streaming.overlap)):
                if value not in (None, 1 if key == "fragments" else 0):
                    raise ValueError(f"streaming.{key}: only method=streaming syncs fragments")
            streaming.fragments, streaming.overlap, streaming.alpha = 1, 0, 0.0
        if self.outer.overlap != "none" and self.method not in ("diloco", "localsgd"):
            raise ValueError(
                f"outer.overlap: {self.outer.overlap} overlaps whole-model DiLoCo rounds (method=diloco or "
                f"localsgd); streaming overlaps fragments with streaming.overlap"
            )
        self._check_shares()
        self._check_elastic()
        self._check_shards()
        if self.method == "ddp" and self.codec.name != "none":
            raise ValueError("codec.name: ddp exchanges gradients every step; codecs apply to pseudo-gradients")
        if self.batch.b_min > self.batch.b_cap:
            raise ValueError(f"batch.b_min ({self.batch.b_min}) is larger than batch.b_cap ({self.batch.b_cap})")
        if self.inner.min_lr > self.inner.lr:
            raise ValueError(f"inner.min_lr ({self.inner.min_lr}) is larger than inner.lr ({self.inner.lr})")
        _check_float32(self)
        return self

    def _check_shares(self) -> None:
        batch = self.batch
        if batch.keep_round_time and self.method == "streaming":
            raise ValueError("batch.keep_round_time: streaming's fragment schedule needs a fixed H (sync_every)")
        if batch.shares == "speed" and self.method == "ddp":
            raise ValueError("batch.shares: ddp averages gradients every step; shares apply to DiLoCo-family methods")
        if isinstance(batch.step_seconds, list) and len(batch.step_seconds) != self.total_workers:
            raise ValueError(
                f"batch.step_seconds: {len(batch.step_seconds)} pairs for {self.total_workers} workers; "
                "give one [a, c] for all or one per worker"
            )

    def _check_elastic(self) -> None:
        if not self.elastic:
            return
        if self.trainers != 1:
            raise ValueError(f"elastic: resizes one trainer's workers; this run has trainers={self.trainers}")
        if self.data.streaming:
            raise ValueError("elastic: a streamed corpus is dealt out to a fixed worker count; use the in-memory one")
        if isinstance(self.batch.step_seconds, list):
            raise ValueError("elastic: batch.step_seconds pins one pair per worker; give one [a, c] for all")
        if self.outer.overlap == "eager":
            raise ValueError("elastic: outer.overlap=eager keeps a copy of θ per worker that a joining worker lacks")

    def _check_shards(self) -> None:
        if self.shards == 1:
            return
        if self.elastic:
            raise ValueError("elastic: resizing a job of sharded workers (shards > 1) is not supported")
        if "format" in self.checkpoint.model_fields_set and self.checkpoint.format == "file":
            raise ValueError("checkpoint.format: sharded workers (shards > 1) write sharded checkpoints")
        self.checkpoint.format = "sharded"

    def _resolve_model(self) -> None:
        model = self.model
        if model.path is not None and model.preset is not None:
            raise ValueError("model: give model.preset or model.path, not both")
        if model.path is None and model.preset is None:
            model.preset = "tiny-bert" if self.task == "classification" else "tiny"
        if self.task == "lm" and model.preset in ("tiny-bert", "small-bert"):
            raise ValueError(
                f"model.preset: {model.preset} is an encoder for task=classification, not a language model"
            )
        if self.task == "lm" and self.data.val_dataset is not None:
            raise ValueError("data.val_dataset: only task=classification reads a separate validation file")

    @property
    def total_workers(self) -> int:
        assert self.trainers is not None and self.workers is not None
        return self.trainers * self.workers

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


FLOAT32_MAX = 3.4028234663852886e38


def _check_float32(section: BaseModel, prefix: str = "") -> None:
    """Every real setting reaches float32 tensors: one beyond its range would overflow mid-run, so refuse it now."""
    for name, value in section:
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            _check_float32(value, f"{key}.")
        elif isinstance(value, float) and abs(value) > FLOAT32_MAX:
            raise ValueError(f"{key}: {value:g} is beyond what float32 holds (at most {FLOAT32_MAX:.4g})")


def _location(parts: tuple) -> str:
    # pydantic names the member of a union it tried ("tuple[float, float]"); a user knows only the key
    return ".".join(str(part) for part in parts if isinstance(part, int) or re.fullmatch(r"\w+", part)) or "config"


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    location = _location(first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown key '{location}'"
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
        return message if location == "config" else f"{location}: {message}"
    if first["type"] == "int_parsing_size":
        message = "not a number this setting can hold (too many digits)"
    given = first.get("input")
    shown = excerpt(given) if not isinstance(given, dict) else "a section"
    return f"{location}: {message} (got {shown})"


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Validate a config dict plus overrides; raises ConfigError with a one-line message."""
    merged = apply_overrides(data or {}, overrides or [])
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None


RUN_CONFIG_FILE = "config.yaml"  # the resolved config, written into every run directory


# What may change when a run resumes: the budget, cadences, how the run is watched and kept, and how its
# arithmetic is carried out (threads, TF32, compilation, stacked workers, the shards of a worker: the same math,
# at most other rounding).
# Anything else (workers, model, data, method, optimizers...) would not fit the checkpoint's state or would change
# its numbers.
RESUME_SAFE_KEYS = (
    "total_tokens",
    "threads",
    "tf32",
    "compile",
    "batched_workers",
    "shards",
    "comm.timeout_s",
    "checkpoint.*",
    "eval.*",
    "run.*",
)


def resume_safe(key: str, elastic: bool = False) -> bool:
    """Whether the dotted ``key`` may change on resume (``workers`` too in an elastic run)."""
    if elastic and key == "workers":
        return True
    return any(key == safe or (safe.endswith(".*") and key.startswith(safe[:-1])) for safe in RESUME_SAFE_KEYS)


def _safe_keys(elastic: bool) -> str:
    return ", ".join(("workers", *RESUME_SAFE_KEYS) if elastic else RESUME_SAFE_KEYS)


def _unsafe_message(key: str, elastic: bool) -> str:
    unless = " unless the run was started with elastic=true" if key == "workers" and not elastic else ""
    return f"'{key}' cannot change when a run resumes{unless}; only {_safe_keys(elastic)} can"


def resume_config(run_dir: Path, overrides: list[str] | None = None) -> TrainConfig:
    """The resolved config a run directory was started with, plus resume-safe ``overrides`` (no model stack)."""
    path = run_dir / RUN_CONFIG_FILE
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"'{run_dir}' is a file, not a run directory")
    if not run_dir.is_dir():
        raise ConfigError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise ConfigError(f"'{run_dir}' is not a run directory (no {RUN_CONFIG_FILE})")
    elastic = load_config(path).elastic
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        if "=" in item and key and not known_key(key):
            raise ConfigError(f"unknown key '{key}'")
        if "=" in item and not resume_safe(key, elastic):
            raise ConfigError(_unsafe_message(key, elastic))
    return load_config(path, overrides)


def known_key(key: str) -> bool:
    """Whether the dotted ``key`` names a setting (or a section) of the config."""
    section: Any = TrainConfig
    for part in key.split("."):
        fields = getattr(section, "model_fields", None)
        if not isinstance(fields, dict) or part not in fields:
            return False
        section = fields[part].annotation
    return True


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def resume_changes(saved: dict[str, Any] | None, config: TrainConfig) -> list[str]:
    """``key: old -> new`` for each setting that differs from the checkpoint's; CheckpointError for an unsafe one."""
    if saved is None:  # a checkpoint from before configs were stored in it
        return []
    # Settings added since the checkpoint was written are absent from it: it ran with their defaults.
    before = {**_flat(TrainConfig().model_dump()), **_flat(saved)}
    after = _flat(config.model_dump())
    changes = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            if not resume_safe(key, config.elastic and before.get("elastic") is True):
                noun = key.split(".")[0] if "." in key else "setting"
                unless = " (workers too in a run started with elastic=true)" if key == "workers" else ""
                raise CheckpointError(
                    f"the checkpoint was written with another {noun}: {key} {excerpt(before.get(key))}, now "
                    f"{excerpt(after.get(key))}; only {_safe_keys(config.elastic)} can change when a run "
                    f"resumes{unless}"
                )
            changes.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return changes


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML config file (optional) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' does not exist") from None
        except (OSError, ValueError) as error:  # ValueError: undecodable bytes, or a NUL in the path
            raise ConfigError(f"config file {str(path)!r} cannot be read: {error}") from None
        try:
            loaded = load_yaml(text)
        except YAMLInputError as error:
            raise ConfigError(f"config file '{path}': {error}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(loaded).__name__}")
        data = loaded
    return build_config(data, overrides)
