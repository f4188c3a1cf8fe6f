"""The Hugging Face Hub, asked only when it can answer: an unreachable Hub switches this process to offline mode
(cached datasets and tokenizers still load) instead of letting each library retry for half a minute."""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 3.0
# What the Hub libraries raise for a name that is neither cached nor reachable (matched by name: their modules
# moved between releases).
_NOT_FOUND = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError", "EntryNotFoundError"}


def looks_local(name: str) -> bool:
    """A path, not a Hub name (``owner/name``): such a name never goes near the Hub."""
    return os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)


def _reachable(endpoint: str, timeout: float) -> bool:
    """One TCP connection to the endpoint, name lookup included, within ``timeout`` seconds."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((parts.hostname or "", port), timeout=timeout):
                outcome.append(True)
        except (OSError, ValueError):
            outcome.append(False)

    thread = threading.Thread(target=connect, daemon=True)  # getaddrinfo itself has no timeout
    thread.start()
    thread.join(timeout)
    return bool(outcome and outcome[0])


def offline_reason(timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be asked (and the Hub libraries are now in offline mode), or None when it can. Behind a
    proxy the libraries' own requests decide: a direct connection says nothing there."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    scheme = urlsplit(constants.ENDPOINT).scheme or "https"
    proxies = urllib.request.getproxies()
    if scheme in proxies or "all" in proxies or _reachable(constants.ENDPOINT, timeout):
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"  # for libraries imported from now on
    constants.HF_HUB_OFFLINE = True
    try:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    return f"the Hub ({constants.ENDPOINT}) cannot be reached from here"


def not_found_offline(error: BaseException, reason: str | None) -> str | None:
    """The reason to name when ``error`` is a Hub library saying a name is neither cached nor reachable while
    offline; None for any other failure (a wrong split, a broken file), which keeps its own message."""
    if reason is None:
        return None
    names = {kind.__name__ for kind in type(error).__mro__}
    text = str(error).lower()
    if names & _NOT_FOUND or "offline" in text or "couldn't connect" in text or "local cache" in text:
        return reason
    return None


def offline_message(kind: str, name: str, reason: str) -> str:
    """One line for a Hub name that is not in the local cache while the Hub cannot be asked."""
    return (
        f"{kind} '{name}' is not in the local Hugging Face cache and {reason}; download it on a connected machine "
        "(or give a local copy)"
    )
