"""b_max probe: the largest micro-batch whose real training step fits a memory budget."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import logging
import resource
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from adloco.algorithms.switch import search_max_batch
from adloco.models.losses import next_token_loss
from adloco.models.precision import autocast_for

if TYPE_CHECKING:
    from adloco.workers.tasks import Task

log = logging.getLogger(__name__)


class MemoryMeter(Protocol):
    """Peak memory of the device a worker trains on, since the last ``reset``."""

    def reset(self) -> None: ...

    def peak_bytes(self) -> int: ...


class CudaMemoryMeter:
    """CUDA allocator statistics: exact peaks, resettable."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))

    def capacity_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)


class ProcessMemoryMeter:
    """Peak resident memory of this process (Linux ``VmHWM``, reset through ``clear_refs``).

    Where the peak cannot be reset, the lifetime peak is used, which only errs on the safe side.
    """

    _status = Path("/proc/self/status")
    _clear = Path("/proc/self/clear_refs")

    def reset(self) -> None:
        gc.collect()
        # Hand freed heap back to the OS first, or an earlier, larger trial would inflate this one's peak.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with contextlib.suppress(OSError):
            self._clear.write_text("5")

    def peak_bytes(self) -> int:
        try:
            for line in self._status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def probe_b_max(step: Callable[[int], None], meter: MemoryMeter, budget_bytes: int, upper: int, lower: int = 1) -> int:
    """Largest batch in [lower, upper] whose ``step`` peaks under ``budget_bytes`` (0 if none does)."""

    def fits(batch: int) -> bool:
        meter.reset()
        try:
            step(batch)
        except (RuntimeError, torch.OutOfMemoryError) as error:
            if not is_out_of_memory(error):
                raise
            return False
        peak = meter.peak_bytes()
        log.info("b_max probe: batch %d peaks at %.1f MiB (budget %.1f MiB)", batch, peak / 2**20, budget_bytes / 2**20)
        return peak <= budget_bytes

    return search_max_batch(fits, upper, lower)


def training_step_at(
    model: torch.nn.Module, context: int, vocab_size: int, task: Task | None = None, precision: str = "fp32"
) -> Callable[[int], None]:
    """A real forward/backward/AdamW step at ``context`` on a scratch copy of ``model``, in the run's precision.

    With a ``task`` the step uses the task's batch shape and loss (default: next-token prediction).
    """
    scratch = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(scratch.parameters(), lr=0.0)
    device = next(scratch.parameters()).device

    def step(batch: int) -> None:
        with autocast_for(precision, device):
            if task is not None:
                loss = task.loss(scratch, *task.scratch_batch(batch, device))
            else:
                tokens = torch.randint(0, vocab_size, (batch, context + 1), device=device)
                loss = next_token_loss(scratch, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
