"""The ``batch`` section and its sub-sections (``statistics``, ``time``, ``scaling``, ``memory``), and the flat names
the sub-sections' keys had before, accepted for one release with a one-line note."""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, Field, field_validator, model_validator

from adloco.config.input import excerpt
from adloco.config.sections import BASIC, _Section
from adloco.errors import RenamedSettingWarning

StepSeconds = tuple[float, float] | list[tuple[float, float]]  # one [a, c] for every worker, or one per worker


class BatchStatisticsConfig(_Section):
    """The gradient-noise statistics the batch test measures, and the test's tolerances (docs/batch-size.md)."""

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
    every: int = Field(1, ge=1, description="Measure the statistics (run the batch test) every this many rounds.")


class BatchTimeConfig(_Section):
    """Step and round times: what the time-aware controller (``batch.controller=time``) weighs and how fast it
    lets b move; pinned times make its decisions reproduce exactly (docs/batch-size.md)."""

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
        "batch.time.round_seconds); null: time it and follow the real steps.",
    )
    round_seconds: float | None = Field(
        None, ge=0, description="controller=time: pin a round's exchange and waiting time; null: measure it."
    )
    keep_round_time: bool = Field(
        False,
        description="As b grows, take fewer inner steps per round so a round reads about as many samples as at "
        "the start: H_r = max(1, round(H·samples at the start / samples now)); not with method=streaming.",
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


class BatchScalingConfig(_Section):
    """How a trainer's inner lr and AdamW β2 follow its batch size when b changes (docs/batch-size.md)."""

    lr: Literal["none", "sqrt", "linear"] = Field(
        "sqrt",
        description="Scale the inner lr by (b/batch.size)^α: none α=0, sqrt α=0.5, linear α=1 (see "
        "docs/batch-size.md).",
    )
    lr_max: float = Field(
        4.0, ge=1, description="The inner lr is scaled by at most this factor (and at least its inverse)."
    )
    beta2: bool = Field(True, description="AdamW β2 → β2^(b/batch.size): the same memory in samples.")


class BatchMemoryConfig(_Section):
    """Micro-batches: the largest one a worker's device holds (b_max, given or probed under a memory budget) and
    switch mode, which accumulates only when the batch asked for is much larger."""

    b_max: int | None = Field(
        None,
        ge=1,
        description="Largest micro-batch per worker; null: probe it under the memory budget, or batch.b_cap without "
        "one.",
    )
    fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="b_max probe on CUDA: share of the GPU's memory the workers a rank hosts on it may peak at; "
        "each worker's step gets an equal part.",
    )
    budget_mb: float | None = Field(
        None, gt=0, description="b_max probe on CPU: peak process memory (MiB) a step may reach; null: no probe."
    )
    switch_factor: float = Field(2.0, ge=1, description="Switch mode n: accumulate only when b_req > n·b_max.")


# The flat names of the keys that moved into a sub-section, old -> (sub-section, key): accepted for one release
# (a YAML file, an override, a dict given to adloco.DiLoCo), each with a one-line note naming the new key.
RENAMED: dict[str, tuple[str, str]] = {
    "estimator": ("statistics", "estimator"),
    "eta": ("statistics", "eta"),
    "theta": ("statistics", "theta"),
    "nu": ("statistics", "nu"),
    "ema": ("statistics", "ema"),
    "groups": ("statistics", "groups"),
    "test_every": ("statistics", "every"),
    "patience": ("time", "patience"),
    "max_growth": ("time", "max_growth"),
    "min_steps_left": ("time", "min_steps_left"),
    "step_seconds": ("time", "step_seconds"),
    "round_seconds": ("time", "round_seconds"),
    "keep_round_time": ("time", "keep_round_time"),
    "lr_scaling": ("scaling", "lr"),
    "lr_scale_max": ("scaling", "lr_max"),
    "beta2_scaling": ("scaling", "beta2"),
    "b_max": ("memory", "b_max"),
    "memory_fraction": ("memory", "fraction"),
    "memory_budget_mb": ("memory", "budget_mb"),
    "switch_factor": ("memory", "switch_factor"),
}


def new_name(key: str) -> str:
    """The dotted key a renamed one is now (``batch.eta`` -> ``batch.statistics.eta``); any other key as given."""
    section, _, name = key.partition(".")
    if section != "batch" or name not in RENAMED:
        return key
    sub, new = RENAMED[name]
    return f"batch.{sub}.{new}"


# A note points at the first caller outside adloco and pydantic: the user's line that gave the old name.
_INSIDE = tuple(
    os.path.join(str(Path(p).resolve()), "") for p in (Path(__file__).parents[1], Path(pydantic.__file__).parent)
)


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel for the first frame outside adloco and pydantic (as pandas'
    find_stack_level): validation runs a variable number of frames below the user's call."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def upgrade_batch(data: Any, note: bool = True) -> Any:
    """A ``batch`` section's input with each old flat name moved into its sub-section; ``note``: warn once per old
    name (a saved config.yaml of an older version is upgraded silently: its user wrote none of it). ValueError
    when the old and the new name of a key are both given."""
    if not isinstance(data, dict) or not any(name in RENAMED for name in data):
        return data
    upgraded = {name: value for name, value in data.items() if name not in RENAMED}
    for name in (name for name in data if name in RENAMED):
        sub, new = RENAMED[name]
        section = upgraded.get(sub)
        section = {} if section is None else section
        if isinstance(section, BaseModel):
            section = section.model_dump(exclude_unset=True)
        if not isinstance(section, dict):
            raise ValueError(f"batch.{sub}: a section of settings, not {excerpt(section)}")
        if new in section:
            raise ValueError(
                f"batch.{name} and batch.{sub}.{new} are the same setting (batch.{name} is its old name); "
                f"give batch.{sub}.{new} only"
            )
        upgraded[sub] = {**section, new: data[name]}
        if note:
            warnings.warn(
                f"batch.{name} is now batch.{sub}.{new} (the old name works until the next release)",
                RenamedSettingWarning,
                stacklevel=_caller_level(),
            )
    return upgraded


class BatchConfig(_Section):
    """The per-worker batch, and for AdLoCo how it adapts: the batch test and its statistics, the time-aware
    controller, how the inner lr and β2 follow b, and micro-batches in memory (docs/batch-size.md)."""

    size: int = Field(
        3, ge=1, description="Per-worker batch b (samples per inner step) at the start.", json_schema_extra=BASIC
    )
    test: Literal["constant", "norm", "inner_product"] | None = Field(
        None, description="Batch-size test; default 'norm' for adloco, 'constant' otherwise."
    )
    controller: Literal["time", "test"] | None = Field(
        None,
        description="How b changes: 'time' picks the batch that reaches a loss soonest on the measured step and "
        "round times (default for adloco); 'test' follows batch.test (default otherwise). See docs/batch-size.md.",
    )
    shares: Literal["equal", "speed"] = Field(
        "equal",
        description="How a trainer's M·b samples per step are split over its workers: 'equal' (b each) or 'speed' "
        "(in proportion to each worker's measured speed, pseudo-gradients averaged with sample weights).",
    )
    b_min: int = Field(1, ge=1, description="Smallest per-worker batch the test may ask for.")
    b_cap: int = Field(64, ge=1, description="Largest per-worker batch the test may ask for.")
    allow_shrink: bool = Field(False, description="Let the test lower b (default: b never decreases).")
    statistics: BatchStatisticsConfig = Field(default_factory=BatchStatisticsConfig)
    time: BatchTimeConfig = Field(default_factory=BatchTimeConfig)
    scaling: BatchScalingConfig = Field(default_factory=BatchScalingConfig)
    memory: BatchMemoryConfig = Field(default_factory=BatchMemoryConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return upgrade_batch(data)
