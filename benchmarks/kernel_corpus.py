"""The large corpus of adloco's benchmarks: the Linux kernel's source, from Debian's ``linux-source-6.12`` package,
prepared into token shards with a byte-level BPE trained on a sample of it.

    python benchmarks/kernel_corpus.py                 # fetch, unpack, prepare (about 1.3 GB of text)
    python benchmarks/kernel_corpus.py --vocab-size 16384 --processes 2

Everything comes from the Debian archive the machine is configured with (``apt-get download``, no root needed once
the package lists exist), so the corpus builds on a machine whose only network is its package mirror. It is
written under runs/corpora/: the package, the unpacked tree (every file of it; binary and non-UTF-8 files are
skipped and counted by the prepare) and the prepared folder, whose manifest records the tokens, shards, time and
the BPE's compression. docs/data.md reports them. Running it again finds the work done.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "linux-source-6.12"
CORPORA = ROOT / "runs" / "corpora"


def fetch(folder: Path) -> Path:
    """The package's .deb in ``folder`` (downloaded once)."""
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=folder, check=True)
        found = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    return found[-1]


def unpack(deb: Path, folder: Path) -> Path:
    """The kernel tree, from the tarball inside the package (unpacked once)."""
    tree = folder / PACKAGE
    if (tree / "Makefile").is_file():
        return tree
    staging = folder / "deb"
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
    (tarball,) = glob.glob(str(staging / "usr" / "src" / f"{PACKAGE}.tar.*"))
    with tarfile.open(tarball) as archive:
        archive.extractall(folder, filter="data")
    shutil.rmtree(staging)
    return tree


def prepare(tree: Path, out: Path, vocab_size: int, processes: int) -> dict:
    """``adloco prepare`` over the tree (every file; a sample spread over it for the BPE); its stats and the CPU it
    kept busy."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [sys.executable, "-m", "adloco", "prepare", str(tree), "--out", str(out), "--suffixes", "*",
               "--vocab-size", str(vocab_size), "--bpe-chars", "1e8", "--bpe-every", "7", "--val-every", "50",
               "--val-documents", "1000", "--processes", str(processes)]  # fmt: skip
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    manifest = json.loads((out / "manifest.json").read_text())
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "manifest": manifest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="prepared folder (runs/corpora/linux-6.12-bpe<V>)")
    args = parser.parse_args()
    tree = unpack(fetch(CORPORA), CORPORA)
    out = args.out or CORPORA / f"linux-6.12-bpe{args.vocab_size // 1024}k"
    result = prepare(tree, out, args.vocab_size, args.processes)
    stats, manifest = result["manifest"]["stats"], result["manifest"]
    print(
        f"{out}: {manifest['train']['tokens']:,} training tokens in {len(manifest['train']['shards'])} shards, "
        f"{manifest['val']['tokens']:,} validation tokens; {stats['bytes_per_token']} bytes per token; "
        f"{stats['mb_per_s']} MB/s, {result['cpu_s'] / max(result['wall_s'], 1e-9):.2f} cores busy"
    )


if __name__ == "__main__":
    main()
