"""One validated configuration object for a run, loaded from YAML plus ``key.sub=value`` overrides."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from adloco.algorithms.schedules import validate_schedule
from adloco.config.batch import BatchConfig, new_name, upgrade_batch
from adloco.config.input import YAMLInputError, apply_overrides, excerpt, load_yaml
from adloco.config.methods import METHODS, names
from adloco.config.sections import (
    BASIC,
    HF_PREFIX,
    CheckpointConfig,
    CodecConfig,
    CommConfig,
    DataConfig,
    EvalConfig,
    FaultToleranceConfig,
    InnerConfig,
    MergeConfig,
    ModelConfig,
    OuterConfig,
    RunConfig,
    StreamingConfig,
    SyncAutoConfig,
)
from adloco.errors import CheckpointError, ConfigError

__all__ = [
    "HF_PREFIX",
    "BatchConfig",
    "CheckpointConfig",
    "CodecConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FaultToleranceConfig",
    "InnerConfig",
    "MergeConfig",
    "ModelConfig",
    "OuterConfig",
    "RunConfig",
    "StreamingConfig",
    "SyncAutoConfig",
    "TrainConfig",
    "apply_overrides",
    "build_config",
    "load_config",
    "resume_config",
]  # the sections live in config/sections.py, the batch section in config/batch.py

# The registered methods (config/methods.py: each one's defaults and rules), as the type a config's `method` has.
MethodName = Literal[tuple(METHODS)]


ADAM_OUTER_LR = 3e-3  # the best of a sweep on the anchor task (docs/optimizers.md)


def _adam_outer_defaults(outer: OuterConfig) -> tuple[float, float, bool]:
    """Adam's own lr default; momentum and Nesterov belong to outer SGD (Adam's momentum is ``outer.betas``)."""
    for key in ("momentum", "nesterov"):
        if getattr(outer, key) not in (None, 0, False):
            raise ValueError(f"outer.{key}: applies to outer.optimizer=sgd; adam's momentum is outer.betas")
    return ADAM_OUTER_LR, 0.0, False


@dataclass(frozen=True)
class WorldSpec:
    """What the ranks of a job must hold, the config's ``world``: every trainer's workers
    (``total_workers``), the worker slots of a rank, the ranks of a worker (``shards``), whether the ranks decide
    the worker count (``elastic``), and the backend and device its ranks exchange with."""

    total_workers: int
    slots_per_rank: int | None
    shards: int
    elastic: bool
    backend: str
    device: str


class TrainConfig(BaseModel):
    """Everything a run needs; every key is documented in docs/configuration.md."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: MethodName = Field(
        "diloco", description=" | ".join(METHODS) + " (docs/methods.md).", json_schema_extra=BASIC
    )
    task: Literal["lm", "classification"] = Field(
        "lm",
        description="lm: next-token prediction on text; classification: labelled texts (jsonl, csv, tsv, parquet); "
        "see docs/models-and-tasks.md.",
        json_schema_extra=BASIC,
    )
    workers: int | None = Field(
        None, ge=1, description="Workers per trainer at the start (M); default 4.", json_schema_extra=BASIC
    )
    trainers: int | None = Field(
        None,
        ge=1,
        description="Model instances (K) of Multi-Instance Training, merged as they go; default 1.",
        json_schema_extra=BASIC,
    )
    sync_every: int | Literal["auto"] | None = Field(
        None,
        description="H: inner steps per round (ddp averages gradients every step; H only sets its round length); "
        "'auto' chooses H while training from measured step and exchange times (section sync_auto).",
        json_schema_extra=BASIC,
    )
    total_tokens: int = Field(
        1_536_000, ge=1, description="Training tokens over all workers and trainers.", json_schema_extra=BASIC
    )
    # Bounded so that every seed derived from it (seed × stride + worker) fits torch's 64-bit generators.
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="Seed for init and data order; same seed ⇒ same numbers.",
        json_schema_extra=BASIC,
    )
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads (default: torch's choice).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where workers train: cuda when available (one GPU per rank), else cpu.",
        json_schema_extra=BASIC,
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Inner steps' forward pass: fp32, or bf16 or fp16 under autocast (weights, optimizer state, "
        "outer state, exchanges and evaluation stay float32; runs on CPU and CUDA). fp16 scales each worker's loss "
        "dynamically: an overflowing step is computed again on the same samples with half the scale. auto: bf16 on "
        "a CUDA GPU that has it, fp32 elsewhere (the run's config.yaml records which).",
        json_schema_extra=BASIC,
    )
    compile: bool = Field(
        False,
        description="torch.compile each training step's forward and backward (a worker group's stacked model, or "
        "each worker's loss). The first steps compile (seconds to minutes); needs a C++ compiler on CPU, Triton "
        "on CUDA, checked at start.",
        json_schema_extra=BASIC,
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
        "the one-by-one path's within float rounding (docs/results/throughput.md); false: one worker at a time.",
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
    sync_auto: SyncAutoConfig = Field(default_factory=SyncAutoConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
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

    @field_validator("sync_every", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto" and not value.strip().isdigit():
            raise ValueError(f"{excerpt(value)} is neither a number of inner steps nor auto")
        return value

    @model_validator(mode="after")
    def _resolve_method_defaults(self) -> TrainConfig:
        self._given = frozenset(self.model_fields_set)
        method = METHODS[self.method]
        self._resolve_model()
        if self.sync_every is None:
            self.sync_every = method.sync_every
        if self.trainers is None:
            self.trainers = method.trainers
        if self.workers is None:
            self.workers = method.workers
        lr, momentum, nesterov = method.outer
        if method.outer_fixed:
            # These baselines are defined by their outer step; a different one would be another method.
            fixed_keys = (("lr", self.outer.lr, lr), ("momentum", self.outer.momentum, momentum))
            for key, value, fixed in (*fixed_keys, ("optimizer", self.outer.optimizer, "sgd")):
                if value is not None and value != fixed:
                    raise ValueError(f"outer.{key}: {self.method} fixes it to {fixed}; use method=diloco to tune it")
        if self.outer.optimizer == "adam":
            lr, momentum, nesterov = _adam_outer_defaults(self.outer)
        self.outer.lr = lr if self.outer.lr is None else self.outer.lr
        self.outer.momentum = momentum if self.outer.momentum is None else self.outer.momentum
        self.outer.nesterov = nesterov if self.outer.nesterov is None else self.outer.nesterov
        if self.outer.nesterov and self.outer.momentum == 0:
            self.outer.nesterov = False
        if self.batch.test is None:
            self.batch.test = method.batch_test
        if self.batch.controller is None:
            self.batch.controller = method.batch_controller
        if self.merge.policy is None:
            self.merge.policy = method.merge if self.trainers > 1 else "off"
        self._check_auto_sync()
        self._resolve_streaming()
        if self.outer.overlap != "none" and not method.overlap:
            raise ValueError(
                f"outer.overlap: {self.outer.overlap} overlaps whole-model DiLoCo rounds (method="
                f"{names(m for m in METHODS.values() if m.overlap)}); streaming overlaps fragments with "
                "streaming.overlap"
            )
        self._check_shares()
        self._check_elastic()
        self._check_shards()
        self._check_fault_tolerance()
        if method.check is not None:
            method.check(self)
        if self.batch.b_min > self.batch.b_cap:
            raise ValueError(f"batch.b_min ({self.batch.b_min}) is larger than batch.b_cap ({self.batch.b_cap})")
        if self.inner.min_lr > self.inner.lr:
            raise ValueError(f"inner.min_lr ({self.inner.min_lr}) is larger than inner.lr ({self.inner.lr})")
        _check_float32(self)
        return self

    def _resolve_streaming(self) -> None:
        streaming = self.streaming
        defaults = METHODS[self.method].fragments
        if defaults is not None:
            fragments, overlap, alpha = defaults
            streaming.fragments = fragments if streaming.fragments is None else streaming.fragments
            streaming.overlap = overlap if streaming.overlap is None else streaming.overlap
            streaming.alpha = alpha if streaming.alpha is None else streaming.alpha
            for h in self.sync_bounds if self.auto_sync else (self.sync_every,):
                validate_schedule(h, streaming.fragments, streaming.overlap)
            return
        for key, value in (("fragments", streaming.fragments), ("overlap", streaming.overlap)):
            if value not in (None, 1 if key == "fragments" else 0):
                syncing = names(m for m in METHODS.values() if m.fragments)
                raise ValueError(f"streaming.{key}: only method={syncing} syncs fragments")
        streaming.fragments, streaming.overlap, streaming.alpha = 1, 0, 0.0

    @property
    def auto_sync(self) -> bool:
        """H chosen while training (``sync_every=auto``)."""
        return self.sync_every == "auto"

    @property
    def sync_bounds(self) -> tuple[int, int]:
        """The H auto may choose: ``sync_auto.min`` up and ``sync_auto.max`` down to multiples of the fragments."""
        return self.sync_auto.bounds(self.streaming.fragments)

    @property
    def first_sync_every(self) -> int:
        """H of the first round: ``sync_every``, or with auto ``sync_auto.start`` within its bounds."""
        if isinstance(self.sync_every, int):
            return self.sync_every
        return self.sync_auto.first(self.streaming.fragments)

    def _check_auto_sync(self) -> None:
        if isinstance(self.sync_every, int) and self.sync_every < 1:
            raise ValueError(f"sync_every: {self.sync_every} inner steps per round; give 1 or more, or auto")
        auto = self.sync_auto
        if auto.min > auto.max:
            raise ValueError(f"sync_auto.min ({auto.min}) is larger than sync_auto.max ({auto.max})")
        if not self.auto_sync:
            return
        if self.batch.time.keep_round_time:
            raise ValueError("batch.time.keep_round_time: sync_every=auto already chooses the round's length")

    def _check_shares(self) -> None:
        batch = self.batch
        if batch.time.keep_round_time and METHODS[self.method].fragments:
            raise ValueError(
                f"batch.time.keep_round_time: {self.method}'s fragment schedule needs a fixed H (sync_every)"
            )
        step_seconds = batch.time.step_seconds
        if isinstance(step_seconds, list) and len(step_seconds) != self.total_workers:
            raise ValueError(
                f"batch.time.step_seconds: {len(step_seconds)} pairs for {self.total_workers} workers; "
                "give one [a, c] for all or one per worker"
            )

    def _check_fault_tolerance(self) -> None:
        ft = self.fault_tolerance
        if ft.lighthouse is None:
            return
        if ft.replica is None or ft.replicas is None:
            raise ValueError("fault_tolerance: a replica needs its index and the job's size (replica, replicas)")
        if ft.replica >= ft.replicas:
            raise ValueError(f"fault_tolerance.replica: {ft.replica} is not below replicas ({ft.replicas})")
        if ft.min_replicas > ft.replicas:
            raise ValueError(
                f"fault_tolerance.min_replicas ({ft.min_replicas}) is larger than replicas ({ft.replicas})"
            )
        several = self.trainers is not None and self.trainers > 1
        if several and (METHODS[self.method].fragments or self.outer.overlap != "none"):
            whole = names(m for m in METHODS.values() if not m.fragments and not m.every_step)
            raise ValueError(
                f"fault_tolerance: several trainers as replicas run method={whole} without outer.overlap for now "
                f"(method={self.method}, outer.overlap={self.outer.overlap})"
            )
        if several and ft.replicas % self.trainers:
            raise ValueError(f"fault_tolerance.replicas: {ft.replicas} replicas do not split into {self.trainers} "
                             "trainers of as many workers")  # fmt: skip

    def _check_elastic(self) -> None:
        if not self.elastic:
            return
        if self.trainers != 1:
            raise ValueError(f"elastic: resizes one trainer's workers; this run has trainers={self.trainers}")
        if self.data.streaming:
            raise ValueError(
                "elastic: a streamed corpus is dealt out to a fixed worker count; use the in-memory one or token files"
            )
        if isinstance(self.batch.time.step_seconds, list):
            raise ValueError("elastic: batch.time.step_seconds pins one pair per worker; give one [a, c] for all")
        if self.outer.overlap == "eager":
            raise ValueError("elastic: outer.overlap=eager keeps a copy of θ per worker that a joining worker lacks")

    def _check_shards(self) -> None:
        if self.shards == 1:
            return
        if self.inner.optimizer == "muon":
            # Newton-Schulz orthogonalizes each whole matrix; a shard holds only some of its rows.
            raise ValueError(
                "inner.optimizer: muon orthogonalizes whole matrices; sharded workers (shards > 1) use adamw"
            )
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
        if self.task == "lm" and self.data.val_dataset is not None and not self.data.names_token_files():
            raise ValueError(
                "data.val_dataset: a separate validation file is read by task=classification and by .bin/.npy token "
                "files"
            )

    @property
    def total_workers(self) -> int:
        assert self.trainers is not None and self.workers is not None
        return self.trainers * self.workers

    @property
    def world(self) -> WorldSpec:
        """What the job's ranks must hold (``cluster.placement.check_world`` checks a world against it)."""
        return WorldSpec(
            self.total_workers, self.slots_per_rank, self.shards, self.elastic, self.comm.backend, self.device
        )

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
        # a message that names its own keys (a section's rule across them) needs no prefix
        return message if location == "config" or message.startswith(f"{location}.") else f"{location}: {message}"
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
    "data.verify",
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


def _as_named_now(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config's flat batch keys of an older version in their sub-sections, silently (no user wrote them)."""
    batch = saved.get("batch")
    return {**saved, "batch": upgrade_batch(batch, note=False)} if isinstance(batch, dict) else saved


def resume_config(run_dir: Path, overrides: list[str] | None = None) -> TrainConfig:
    """The resolved config a run directory was started with, plus resume-safe ``overrides`` (no model stack)."""
    path = run_dir / RUN_CONFIG_FILE
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"'{run_dir}' is a file, not a run directory")
    if not run_dir.is_dir():
        raise ConfigError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise ConfigError(f"'{run_dir}' is not a run directory (no {RUN_CONFIG_FILE})")
    saved = _read_config_file(path)
    try:
        saved = _as_named_now(saved)
    except ValueError as error:  # a hand-edited one giving a batch key under both names
        raise ConfigError(f"config file '{path}': {error}") from None
    elastic = build_config(saved).elastic
    for item in overrides or []:
        key = new_name(item.partition("=")[0].strip())  # an old name is refused under the key it is now
        if "=" in item and key and not known_key(key):
            raise ConfigError(f"unknown key '{key}'")
        if "=" in item and not resume_safe(key, elastic):
            raise ConfigError(_unsafe_message(key, elastic))
    return build_config(saved, overrides)


def setting_tier(model: type[BaseModel], name: str) -> str:
    """'basic' or 'advanced': the tier a field of a config section is marked with."""
    extra = model.model_fields[name].json_schema_extra
    return "basic" if isinstance(extra, dict) and extra.get("tier") == BASIC["tier"] else "advanced"


def basic_settings(config: BaseModel) -> dict[str, Any]:
    """The basic settings of ``config`` as nested sections (what ``--print-config`` shows), values resolved."""
    dumped = config.model_dump(mode="json")
    shown: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            section = basic_settings(value)
            if section:
                shown[name] = section
        elif setting_tier(type(config), name) == "basic":
            shown[name] = dumped[name]
    return shown


def count_settings(model: type[BaseModel] = TrainConfig) -> tuple[int, int]:
    """(basic, all): how many settings ``model`` has, sections unfolded."""
    basic = total = 0
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            inner = count_settings(field.annotation)
            basic, total = basic + inner[0], total + inner[1]
        else:
            basic, total = basic + (setting_tier(model, name) == "basic"), total + 1
    return basic, total


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
    saved = _as_named_now(saved)
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


def _read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file's mapping of keys; ConfigError with one line when it cannot be one."""
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
    if not isinstance(loaded, dict | None):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys, not {type(loaded).__name__}")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML config file (optional) and apply overrides."""
    return build_config({} if path is None else _read_config_file(Path(path)), overrides)
