"""Window order without an index array: a keyed permutation of a corpus's windows, and a worker's stream whose
whole state is one counter.

A token corpus of T training tokens has ``n = (T - 1) // context`` windows of ``context + 1`` tokens (window k
starts at token k·context, so neighbours share one token and every token is a target once per epoch). The
samples of a run are one endless sequence of *positions*: position p is window ``π_e(p mod n)`` of epoch
``e = p // n``, where π_e is a bijection of [0, n) keyed by (seed, e). Worker w of W reads positions
``base + w + W·i`` for i = 0, 1, …; its state is i (and the base and stride, which change only when the number of
workers does). So, whatever the batch sizes:

- within an epoch every window is drawn once over all workers and none twice;
- a worker's i-th sample is a pure function of (seed, base, W, w, i): a change of b between rounds changes how the
  samples are grouped into steps, never which samples they are, and a resume at any count is O(1);
- when W changes (an elastic resume) the next base is the first position past every worker's reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from adloco.errors import DataError

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudo-random function make a strong pseudo-random permutation
SAMPLER = "windows-v1"  # the stream state's tag: a checkpoint of another sampler is refused, not misread


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping arithmetic): a fast 64-bit avalanche."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class WindowOrder:
    """A bijection of [0, n) keyed by (seed, epoch): a balanced Feistel network on the smallest even number of
    bits that covers n, walked in cycles until it lands inside [0, n) (at most four tries per index on average).
    Nothing of size n is ever held."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a window order needs at least one window, got {n}")
        self.n = int(n)
        self.seed = int(seed)
        bits = max(2, int(self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self._keys: dict[int, np.ndarray] = {}

    def _round_keys(self, epoch: int) -> np.ndarray:
        keys = self._keys.get(epoch)
        if keys is None:
            material = np.array([self.seed & 0xFFFFFFFFFFFFFFFF, epoch], dtype=np.uint64)
            start = _mix(_mix(material[:1]) ^ material[1:])
            keys = _mix(start + np.arange(_ROUNDS, dtype=np.uint64))
            if len(self._keys) > 8:
                self._keys.clear()
            self._keys[epoch] = keys
        return keys

    def _feistel(self, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
        shift, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = values >> shift, values & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    def __call__(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """π_epoch(indices) for indices in [0, n), as int64."""
        if self.n == 1:
            return np.zeros(len(indices), dtype=np.int64)
        keys = self._round_keys(int(epoch))
        out = self._feistel(np.asarray(indices, dtype=np.uint64), keys)
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: the permutation of the larger domain restricted to [0, n)
            out[outside] = self._feistel(out[outside], keys)
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class WindowCursor:
    """Worker ``worker`` of ``workers`` in the run's window order: its samples are the positions
    ``base + worker + workers·i``; ``count`` (i) is its whole state with the base and the stride."""

    def __init__(self, n: int, seed: int, worker: int, workers: int) -> None:
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of {workers}")
        self.order = WindowOrder(n, seed)
        self.base, self.stride, self.offset, self.count = 0, workers, worker, 0

    def positions(self, size: int) -> np.ndarray:
        """The positions of the next ``size`` samples."""
        i = np.arange(self.count, self.count + size, dtype=np.int64)
        return self.base + self.offset + self.stride * i

    def windows_at(self, positions: np.ndarray) -> np.ndarray:
        """The window of each position: its epoch's permutation of its place in the epoch."""
        epochs, places = np.divmod(positions, self.order.n)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.order(int(epoch), places[chosen])
        return out

    def take(self, size: int) -> np.ndarray:
        """The windows of the next ``size`` samples, which are read from now on."""
        windows = self.windows_at(self.positions(size))
        self.count += size
        return windows

    def skip(self, samples: int) -> None:
        """Read past ``samples`` samples without reading them (a replica catching up with its peers)."""
        self.count += int(samples)

    def state_dict(self) -> dict:
        return {"sampler": SAMPLER, "windows": self.order.n, "base": self.base, "stride": self.stride,
                "offset": self.offset, "count": self.count}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not is_window_stream(state):
            raise DataError(
                "the checkpoint's data stream is not one over token files (was the run started on another "
                "data.dataset?)"
            )
        if int(state["windows"]) != self.order.n:
            raise DataError(
                f"the token files have {self.order.n:,} windows, the run started on {int(state['windows']):,}: "
                "they changed since (resume on the same files)"
            )
        self.base, self.stride = int(state["base"]), int(state["stride"])
        self.offset, self.count = int(state["offset"]), int(state["count"])


class Windows(Protocol):
    """What a stream reads: the training tokens as windows."""

    def windows(self, context: int) -> int: ...

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray: ...


class WindowStream:
    """A worker's samples from token files: windows in the cursor's order; ``next_batch`` returns inputs and
    next-token targets (exactly one shift)."""

    def __init__(self, tokens: Windows, context: int, seed: int, worker: int, workers: int) -> None:
        self.tokens = tokens
        self.context = context
        self.cursor = WindowCursor(tokens.windows(context), seed, worker, workers)

    def next_batch(self, size: int) -> tuple[Any, Any]:
        import torch

        windows = torch.from_numpy(self.tokens.gather(self.cursor.take(size) * self.context, self.context + 1))
        return windows[:, :-1], windows[:, 1:]

    def skip(self, samples: int) -> None:
        self.cursor.skip(samples)

    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor.load_state_dict(state)


def cursor_end(state: Mapping[str, Any]) -> int:
    """The first position of the row after a saved cursor's last sample: every position of its own below that
    is read."""
    return int(state["base"]) + int(state["stride"]) * int(state["count"])


def regrouped(ends: Mapping[int, int], windows: int, workers: int) -> dict[int, dict]:
    """The cursors of ``workers`` workers continuing where the saved ones stopped (``ends``: every saved worker's
    ``cursor_end``): the new base is the first position past all their reads (rows some workers had not finished
    are skipped), the stride the new worker count, each count zero."""
    if not ends:
        raise ValueError("regrouping needs the saved cursors' ends")
    base = max(ends.values())
    return {
        w: {"sampler": SAMPLER, "windows": windows, "base": base, "stride": workers, "offset": w, "count": 0}
        for w in range(workers)
    }


def is_window_stream(state: Any) -> bool:
    """Whether a saved stream state is a ``WindowStream``'s."""
    return isinstance(state, Mapping) and state.get("sampler") == SAMPLER
