"""The errors reported as one line (exit code 2 for bad input, 1 for a failing write), in a module that imports
nothing heavy: the command line can name a typo or a missing run directory before torch is loaded."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name where it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key."""

    def __str__(self) -> str:
        # Messages quote user input, which may hold line breaks; the report must stay one line.
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


class RenamedSettingWarning(FutureWarning):
    """A setting given under the name it had before a release renamed it: one line naming the new key (a
    FutureWarning, so that end users see it, unlike a DeprecationWarning)."""


class DataError(ValueError):
    """A data file that cannot be used, reported as one line."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, reported as one line."""


class StorageError(RuntimeError):
    """A write into the run directory failed mid-run (full disk, read-only file system): one line, exit code 1."""

    disk_full: bool = False  # the run can go on once space is freed
