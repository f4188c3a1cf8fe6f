"""Numbers for people: counts and durations short enough for a progress bar or a table cell."""

from __future__ import annotations


def short_count(value: float) -> str:
    """1234 -> 1.23k, 1536000 -> 1.54M: three significant digits, for a narrow bar or cell."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.0f}"


def duration(seconds: float) -> str:
    """5h03m, 12m05s, 42s."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
