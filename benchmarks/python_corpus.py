"""A second benchmark corpus that every machine has: the ``.py`` sources of the running Python's standard library.

    python benchmarks/python_corpus.py            # build (or find) it and print where it is and what it holds

About 30 MB of code in some 1,800 files (Python 3.11), so nothing measured on it is tuned to Tiny Shakespeare.
It is a benchmark corpus, not a bundled dataset: it is written once per Python version into
runs/corpora/python-stdlib-<version>.jsonl (one JSON line per file, the text under "text"), and the results
record the version, file count, size and digest. Third-party packages (site-packages) are left out. The files
are ordered by a hash of their relative path rather than alphabetically, so the trailing validation split is a
sample of the whole library rather than its last packages (xml, zipfile, zoneinfo).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path

from adloco.checkpoint import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_sources(stdlib: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``.py`` file under ``stdlib``, in the corpus's hashed order."""
    sources = []
    for folder, subfolders, files in os.walk(stdlib):
        subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED_FOLDERS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test files are deliberately not UTF-8
            if text.strip() and "\0" not in text:
                sources.append((path.relative_to(stdlib).as_posix(), text))
    return sorted(sources, key=lambda source: hashlib.sha256(source[0].encode()).hexdigest())


def build(out_dir: Path = ROOT / "runs" / "corpora", stdlib: Path | None = None) -> tuple[Path, dict]:
    """The corpus file for this Python (written once, atomically) and what it holds."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    version = platform.python_version()
    path = out_dir / f"python-stdlib-{version}.jsonl"
    info_path = path.with_suffix(".json")
    if path.exists() and info_path.exists():
        return path, json.loads(info_path.read_text())
    sources = stdlib_sources(stdlib)
    if not sources:
        raise SystemExit(f"no .py sources found under {stdlib}")
    body = "".join(json.dumps({"text": text, "path": rel}) + "\n" for rel, text in sources).encode()
    info = {
        "corpus": "Python standard library .py sources",
        "python": version,
        "implementation": platform.python_implementation(),
        "files": len(sources),
        "characters": sum(len(text) for _, text in sources),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    atomic_write_bytes(path, body)
    atomic_write_bytes(info_path, (json.dumps(info, indent=1) + "\n").encode())  # last: it marks the corpus whole
    return path, info


if __name__ == "__main__":
    corpus, facts = build()
    print(corpus)
    print(json.dumps(facts, indent=1))
