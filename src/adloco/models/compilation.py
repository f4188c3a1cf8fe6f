"""``compile=true``: the training step's forward (and so its backward) through ``torch.compile``.

What is compiled is the function a step calls for its loss: a worker group's stacked model, or a worker's loss of
its model. Whether compilation can run at all (a C++ compiler on CPU, Triton on CUDA) is checked once at start,
so a run that cannot compile stops there with a one-line error instead of failing at its first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from adloco.errors import ConfigError

F = TypeVar("F", bound=Callable)


def compiled(function: F, enabled: bool) -> F:
    """``function`` through torch.compile when ``enabled``; shapes that change (the last micro-batch of a split,
    a new batch size) recompile once and are then handled as dynamic."""
    return torch.compile(function) if enabled else function


def check_compile(device: torch.device) -> None:
    """Compile and run a tiny function on ``device``; ConfigError naming the cause where that fails."""
    probe = torch.compile(lambda x: torch.nn.functional.silu(x) * 2.0)
    try:
        probe(torch.ones(8, device=device))
    except Exception as error:  # inductor, Triton and the C++ toolchain raise many kinds; all mean "cannot compile"
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"compile: torch.compile cannot run on {device.type} here ({first})") from None
