"""What ``adloco prepare`` shows while it works: a bar with MB/s, tokens/s and the ETA on a terminal, a plain line
every few seconds when the output is a file or a pipe."""

from __future__ import annotations

import time
from typing import Any

PLAIN_EVERY_S = 10.0


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class PrepareProgress:
    """Progress over ``total`` bytes of source (None when unknown: no bar, no ETA)."""

    def __init__(self, console: Any, total: int | None, every_s: float = PLAIN_EVERY_S) -> None:
        self.console, self.total, self.every_s = console, total, every_s
        self.started = time.perf_counter()
        self.shown = self.started
        self.done_bytes, self.tokens, self.past = 0, 0, 0
        self.live = console.is_terminal
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> PrepareProgress:
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.fields[line]}"),
                                      console=self.console, transient=True)  # fmt: skip
            self._progress.__enter__()
            self._task = self._progress.add_task("prepare", total=self.total, line="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def line(self) -> str:
        seconds = time.perf_counter() - self.started
        mb_s = _rate(self.done_bytes / 1e6, seconds)
        text = f"{self.done_bytes / 1e6:,.1f} MB · {mb_s:,.1f} MB/s · {_rate(self.tokens, seconds):,.0f} tokens/s"
        if self.total:
            reached = self.done_bytes + self.past
            share = min(1.0, reached / self.total)
            left = max(0, self.total - reached) / 1e6 / mb_s if mb_s > 0 else float("nan")
            text = f"{share:.1%} · {text}" + (f" · ETA {_clock(left)}" if left == left else "")
        return text

    def update(self, done_bytes: int, tokens: int, past: int = 0) -> None:
        """Bytes and tokens tokenized by this prepare, and ``past``: bytes a resume found written already."""
        self.done_bytes, self.tokens, self.past = done_bytes, tokens, past
        if self._progress is not None:
            reached = min(done_bytes + past, self.total or done_bytes + past)
            self._progress.update(self._task, completed=reached, line=self.line())
            return
        now = time.perf_counter()
        if now - self.shown >= self.every_s:
            self.shown = now
            self.console.print(f"adloco: prepare: {self.line()}", markup=False, highlight=False, soft_wrap=True)
