"""Token files in a user's own loop: a ``torch.utils.data`` dataset of windows and a batch sampler whose order and
state are a worker's cursor in the run's window order (``adloco.data.sampling``), as ``adloco train`` reads them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from adloco.data.sampling import WindowCursor
from adloco.data.token_files import open_token_source


class TokenWindows(torch.utils.data.Dataset):
    """The windows of ``context + 1`` tokens of token files (a prepared folder, .bin or .npy files): item ``i`` is
    window ``i`` as (inputs, targets), targets shifted by one. ``split`` is "train" or "val"."""

    def __init__(self, dataset: str, context: int, split: str = "train", val_dataset: str | None = None,
                 val_fraction: float = 0.1, verify: bool = True) -> None:  # fmt: skip
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        source = open_token_source(dataset, val_dataset, val_fraction, verify)
        tokens = source.train if split == "train" else source.val
        if tokens is None or tokens.windows(context) < 1:
            raise ValueError(f"'{dataset}' has no {split} window of {context + 1} tokens")
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return self.tokens.windows(self.context)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.__getitems__([index])
        return inputs[0], targets[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch in one read (``DataLoader`` calls it with a batch sampler's list; pass
        ``collate_fn=lambda batch: batch``)."""
        windows = torch.from_numpy(self.tokens.gather(np.asarray(indices, dtype=np.int64) * self.context,
                                                      self.context + 1))  # fmt: skip
        return windows[:, :-1], windows[:, 1:]

    def sampler(self, batch_size: int, worker: int = 0, workers: int = 1, seed: int = 0) -> WindowSampler:
        """Worker ``worker`` of ``workers``'s batches of ``batch_size`` windows, disjoint from the other workers'
        within an epoch; ``state_dict`` is one counter."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        return WindowSampler(len(self), seed, worker, workers, lambda: batch_size)


class WindowSampler(torch.utils.data.Sampler):
    """Index lists of ``size()`` windows per step from a worker's cursor (``size`` may change between steps, as
    AdLoCo's batch does); endless."""

    def __init__(self, windows: int, seed: int, worker: int, workers: int, size: Callable[[], int]) -> None:
        self.cursor = WindowCursor(windows, seed, worker, workers)
        self.size = size

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.cursor.take(self.size()).tolist()

    def state_dict(self) -> dict[str, Any]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
