"""Stopping a run the way a batch scheduler asks: SIGTERM or SIGUSR1 -> checkpoint at the round's end -> exit.

A checkpoint holds a round boundary (the outer state of every method is whole only there), so a signal is acted
on when the round in progress ends. The exception that ends the run names the checkpoint and the exact command
that resumes it; Ctrl-C stops at once and says the same about the last checkpoint written.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def resume_command(run_dir: Path) -> str:
    """The command line that continues ``run_dir``."""
    return shlex.join(["adloco", "train", "--resume", str(run_dir)])


def where_to_resume(run_dir: Path, checkpoint_round: int | None) -> str:
    """What a stopped run leaves: the command that resumes it, or that nothing was checkpointed yet."""
    if checkpoint_round is None:
        return f"no checkpoint was written yet in {run_dir}; start the run again"
    return f"checkpoint of round {checkpoint_round} in {run_dir}; resume with: {resume_command(run_dir)}"


class Stopped(Exception):
    """The run stopped on a signal after checkpointing; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int, run_dir: Path, checkpoint_round: int | None) -> None:
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped on {name}: {where_to_resume(run_dir, checkpoint_round)}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the run left behind."""

    def __init__(self, run_dir: Path, checkpoint_round: int | None) -> None:
        super().__init__(f"interrupted: {where_to_resume(run_dir, checkpoint_round)}")


class StopSignals:
    """While entered, SIGTERM and SIGUSR1 only set ``requested``; the previous handlers come back on exit.

    Under torchrun each rank holds its own; the request travels in the round's reports, so the ranks stop at the
    same round boundary whichever of them got the signal (``rank`` names the one speaking).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.enabled = threading.current_thread() is threading.main_thread()  # Python's rule
        self.requested: int | None = None
        self.interrupted = False
        self._who = "" if rank is None else f"rank {rank}: "
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            name = signal.Signals(signum).name
            print(f"adloco: {self._who}{name} received; stopping at a round's end", file=sys.stderr, flush=True)
        self.requested = signum

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def raise_if_interrupted(self) -> None:
        """Raise the Ctrl-C that Python swallowed: one raised inside a finalizer (a generator's ``finally``, a
        ``__del__``) is only printed as "Exception ignored", and the run would otherwise go on to its end."""
        if self.interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored or custom one stays
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
