"""How fast and how lean the token-file data path is (docs/data.md, "Throughput").

    python benchmarks/data_pipeline.py throughput [--folder DIR]   # (inputs, targets) per second, one process
    python benchmarks/data_pipeline.py memory                      # adloco train over 4 GB vs 40 MB of tokens
    python benchmarks/data_pipeline.py resume                      # a cursor at 10^9 samples to its first batch
    python benchmarks/data_pipeline.py prepare --source DIR        # adloco prepare with 1 and 2 processes
    python benchmarks/data_pipeline.py encoders --source DIR --tokenizer TOK  # tiktoken against tokenizers
    python benchmarks/data_pipeline.py --write                     # the table in docs/data.md from the results

Each measurement is stored under its name in benchmarks/results/data_pipeline.json with the machine it ran on.
Throughput is timed through the code training runs (``WindowStream.next_batch`` over a prepared folder), with
the page cache warm (a pass over the batches first), and beside it, in the same process and on the same text, the
two paths it replaces: the in-memory corpus (``TokenStream``, the default run's) and a streamed corpus tokenized
on the fly (``PackedStream`` with a BPE). The synthetic folders (random byte tokens) are written under
runs/corpora/synthetic-*; the 4 GB one is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import describe, environment

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "data_pipeline.json"
DOC = ROOT / "docs" / "data.md"
MARKERS = ("<!-- data-pipeline:begin -->", "<!-- data-pipeline:end -->")
CORPORA = ROOT / "runs" / "corpora"


def synthetic_folder(path: Path, tokens: int, shard_tokens: int = 100_000_000) -> Path:
    """A prepared folder of ``tokens`` random byte-level ids (written once), as ``adloco prepare`` writes one."""
    from adloco.data.token_files import Manifest, ShardRecord, shard_name, write_manifest, write_tokens

    if (path / "manifest.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    manifest = Manifest(dtype="uint16", vocab_size=256, eot_id=0, tokenizer={"type": "byte", "origin": "byte"},
                        source={"dataset": "synthetic"}, settings={"tokens": tokens})  # fmt: skip
    for split, count in (("train", tokens), ("val", max(10_000, tokens // 1000))):
        records = manifest.train if split == "train" else manifest.val
        for start in range(0, count, shard_tokens):
            size = min(shard_tokens, count - start)
            chunks = (rng.integers(0, 256, min(1 << 24, size - at), dtype=np.uint16) for at in range(0, size, 1 << 24))
            name = shard_name(split, len(records))
            digest, largest = write_tokens(path / name, chunks)
            records.append(ShardRecord(name, size, 1, digest, largest))
    manifest.complete = True
    write_manifest(path, manifest)
    return path


def _timed_batches(stream, batch: int, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        stream.next_batch(batch)
    return time.perf_counter() - started


def throughput(folder: Path, context: int, batch: int, batches: int, repeats: int) -> dict:
    """Tokens of (inputs, targets) per second from the folder, and from the paths it replaces."""
    import torch

    from adloco.config import build_config
    from adloco.data import StreamingCorpus, TokenStream, load_corpus, resolve_source, train_bpe
    from adloco.data.tokenization import ByteTokenizer

    torch.set_num_threads(1)
    config = build_config(overrides=[f"data.dataset={folder}", "data.verify=size"])
    corpus = load_corpus(config.data, ByteTokenizer(), context, seed=0)
    stream = corpus.stream(context, 0, worker=0, workers=1)
    _timed_batches(stream, batch, batches)  # the pages of the batches' windows come into the cache
    files = [statistics.median(_timed_batches(stream, batch, batches) for _ in range(repeats))]
    tokens = batch * context * batches
    # the same number of windows from the default run's in-memory split, and from a BPE stream of Shakespeare
    memory = TokenStream(torch.randint(0, 256, (len(corpus.train),), dtype=torch.long), context, 0)
    in_memory = statistics.median(_timed_batches(memory, batch, batches) for _ in range(repeats))
    source = resolve_source("tinyshakespeare")
    bpe = train_bpe(source.documents(streaming=True), 4096)
    streamed = StreamingCorpus.load(source, bpe, context, 2000, 64).stream(context, 0, 0, 1)
    few = max(1, batches // 20)
    packed = statistics.median(_timed_batches(streamed, batch, few) for _ in range(repeats)) * batches / few
    return {
        "folder": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else folder.name,
        "folder_tokens": len(corpus.train),
        "context": context,
        "batch": batch,
        "batches": batches,
        "repeats": repeats,
        "token_files_tokens_per_s": round(tokens / files[0]),
        "in_memory_tokens_per_s": round(tokens / in_memory),
        "bpe_stream_tokens_per_s": round(tokens / packed),
    }


def _train_rss(folder: Path, root: Path) -> dict:
    """A short real run over the folder: the largest resident memory its rounds recorded, and its start."""
    name = folder.name
    command = [sys.executable, "-m", "adloco", "train", f"data.dataset={folder}", "total_tokens=40000",
               "workers=2", "eval.every=1000", "eval.final_full=false", "eval.blocks=8", "run.progress=false",
               "run.save_final=false", "run.plots=false", f"run.root={root}", f"run.name={name}",
               "threads=2"]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r["kind"] == "round"]
    return {"peak_rss_mib": max(m["peak_rss_mib"] for r in rounds for m in r["memory"]),
            "last_rss_mib": rounds[-1]["memory"][0]["rss_mib"],
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def memory(big_gb: float, keep: bool) -> dict:
    """Resident memory of a training process over a large and a small token folder."""
    import shutil

    small = synthetic_folder(CORPORA / "synthetic-40mb", 20_000_000)
    big = synthetic_folder(CORPORA / f"synthetic-{big_gb:g}gb", int(big_gb * 1e9 / 2))
    root = CORPORA / "memory-runs"
    shutil.rmtree(root, ignore_errors=True)
    result = {"small_tokens": 20_000_000, "big_tokens": int(big_gb * 1e9 / 2)}
    for label, folder in (("small", small), ("big", big)):
        result[label] = _train_rss(folder, root)
    result["difference_mib"] = round(result["big"]["peak_rss_mib"] - result["small"]["peak_rss_mib"], 1)
    shutil.rmtree(root, ignore_errors=True)
    if not keep:
        shutil.rmtree(big)
    return result


def resume(samples: int, context: int, batch: int, repeats: int, folder: Path | None = None) -> dict:
    """From a saved cursor at ``samples`` samples to the first batch: open the folder, load the state, read."""
    from adloco.config import build_config
    from adloco.data import load_corpus
    from adloco.data.tokenization import ByteTokenizer

    folder = folder or synthetic_folder(CORPORA / "synthetic-40mb", 20_000_000)
    config = build_config(overrides=[f"data.dataset={folder}", "data.verify=size"])
    state = load_corpus(config.data, ByteTokenizer(), context, seed=0).stream(context, 0, 0, 4).state_dict()
    state["count"] = samples
    times, opened = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        corpus = load_corpus(config.data, ByteTokenizer(), context, seed=0)
        stream = corpus.stream(context, 0, 0, 4)
        middle = time.perf_counter()
        stream.load_state_dict(state)
        stream.next_batch(batch)
        times.append(time.perf_counter() - middle)
        opened.append(time.perf_counter() - started)
    return {"samples": samples, "context": context, "batch": batch, "repeats": repeats,
            "cursor_to_batch_s": round(statistics.median(times), 6),
            "open_cursor_to_batch_s": round(statistics.median(opened), 6)}  # fmt: skip


def prepare_rates(source: Path, tokenizer: str, repeats: int) -> dict:
    """``adloco prepare`` of ``source`` with one and with two processes: MB/s and the cores it kept busy."""
    import shutil

    rows = {}
    for processes in (1, 2):
        runs = []
        for _ in range(repeats):
            out = CORPORA / f"prepare-bench-{processes}"
            shutil.rmtree(out, ignore_errors=True)
            command = [sys.executable, "-m", "adloco", "prepare", str(source), "--out", str(out), "--tokenizer",
                       tokenizer, "--processes", str(processes), "--suffixes", "*", "-q"]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True)
            stats = json.loads((out / "manifest.json").read_text())["stats"]
            runs.append((stats["mb_per_s"], stats.get("cores_busy")))
            shutil.rmtree(out)
        rows[str(processes)] = {"mb_per_s": statistics.median(r[0] for r in runs),
                              "cores_busy": statistics.median(r[1] for r in runs if r[1] is not None)}  # fmt: skip
    return {"source": source.name, "tokenizer": Path(tokenizer).name, "repeats": repeats, "processes": rows}


def encoders(source: Path, tokenizer: Path, megabytes: float) -> dict:
    """One process, one thread: a byte-level BPE's MB/s through tiktoken (converted) and through tokenizers, on the
    first ``megabytes`` of a folder's files, and whether their ids agree."""
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from adloco.data.encoding import Encoder
    from adloco.data.sources import folder_files

    texts, size = [], 0
    for path in folder_files(source, ("*",)):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        size += len(texts[-1].encode())
        if size >= megabytes * 1e6:
            break
    rates, ids = {}, {}
    for engine in ("tiktoken", "tokenizers"):
        encoder = Encoder(engine, str(tokenizer / "tokenizer.json"), 0, "uint32")
        started = time.perf_counter()
        ids[engine] = encoder.ids(texts)
        rates[engine] = round(size / 1e6 / (time.perf_counter() - started), 2)
    same = all(np.array_equal(a, b) for a, b in zip(ids["tiktoken"], ids["tokenizers"], strict=True))
    return {"source": source.name, "megabytes": round(size / 1e6, 1), "documents": len(texts),
            "tokens": int(sum(len(i) for i in ids["tiktoken"])), "mb_per_s": rates, "same_ids": same}  # fmt: skip


def render(results: dict) -> str:
    lines = ["| measurement | result | target |", "| --- | --- | --- |"]
    t = results.get("throughput")
    if t:
        lines.append(
            f"| (inputs, targets) from a prepared folder, context {t['context']}, batch {t['batch']}, one process "
            f"| **{t['token_files_tokens_per_s']:,} tokens/s** (the in-memory split of the default run "
            f"{t['in_memory_tokens_per_s']:,}; a streamed corpus tokenized on the fly, 4k BPE over Shakespeare's "
            f"lines: {t['bpe_stream_tokens_per_s']:,}) | ≥ 5,000,000 |"
        )
    m = results.get("memory")
    if m:
        lines.append(
            f"| resident memory of `adloco train` over {m['big_tokens'] * 2 / 1e9:g} GB of tokens against 40 MB "
            f"| **{m['difference_mib']:+.1f} MiB** (peak {m['big']['peak_rss_mib']:,.0f} against "
            f"{m['small']['peak_rss_mib']:,.0f} MiB) | ≤ +64 MB |"
        )
    r = results.get("resume")
    if r:
        lines.append(
            f"| resume at {r['samples']:,} samples to the first batch | **{r['cursor_to_batch_s'] * 1e3:.2f} ms** "
            f"(with opening the folder, sizes checked: {r['open_cursor_to_batch_s'] * 1e3:.1f} ms) | < 1 s |"
        )
    p = results.get("prepare")
    if p:
        rows = p.get("processes", p.get("workers"))
        one, two = rows["1"], rows["2"]
        lines.append(
            f"| `adloco prepare` of {p['source']} with its 32k BPE | **{two['mb_per_s']:.1f} MB/s "
            f"with 2 processes ({two['mb_per_s'] / 2:.1f} a core, {two['cores_busy']:.2f} cores busy)**; "
            f"{one['mb_per_s']:.1f} MB/s with 1 | ≥ 5 MB/s a core, both busy |"
        )
    e = results.get("encoders")
    if e:
        lines.append(
            f"| a 32k byte-level BPE in one process and thread, {e['megabytes']:,.0f} MB of {e['source']} | "
            f"**tiktoken {e['mb_per_s']['tiktoken']:.1f} MB/s**, tokenizers {e['mb_per_s']['tokenizers']:.1f} MB/s; "
            f"{'the same' if e['same_ids'] else 'DIFFERENT'} {e['tokens']:,} ids | (the fast encoder's reason) |"
        )
    k = results.get("kernel")
    if k:
        lines.append(
            f"| the kernel corpus prepared (linux-source-6.12, {k['text_mb']:,.0f} MB of text) | "
            f"{k['train_tokens']:,} training tokens in {k['shards']} shards, {k['val_tokens']:,} validation; "
            f"{k['bytes_per_token']:.2f} bytes per token; {k['seconds']:.0f} s tokenizing "
            f"({k['mb_per_s']:.1f} MB/s) | reported |"
        )
    dates = sorted({v["environment"]["date"] for v in results.values()})
    env = next(iter(results.values()))["environment"]
    stamp = describe({**env, "date": " and ".join(dates), "machine": "a 2-core x86_64 CPU"})
    return "\n".join([*lines, "", f"Measured {stamp}; throughput and resume with one torch thread."])


def _store(name: str, result: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[name] = {**result, "environment": environment()}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results[name], indent=2))


def kernel_result(folder: Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    stats = manifest["stats"]
    return {"folder": folder.name, "train_tokens": manifest["train"]["tokens"],
            "val_tokens": manifest["val"]["tokens"], "shards": len(manifest["train"]["shards"]),
            "text_mb": stats["text_bytes_this_run"] / 1e6, "bytes_per_token": stats["bytes_per_token"],
            "seconds": stats["seconds"], "mb_per_s": stats["mb_per_s"], "cores_busy": stats.get("cores_busy"),
            "skipped_files": stats["skipped_files"], "vocab_size": manifest["vocab_size"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["throughput", "memory", "resume", "prepare", "encoders", "kernel"])
    parser.add_argument("--folder", type=Path, default=None, help="throughput: a prepared folder (synthetic 40 MB)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-gb", type=float, default=4.0)
    parser.add_argument("--keep", action="store_true", help="memory: keep the large synthetic folder")
    parser.add_argument("--source", type=Path, default=None, help="prepare: a text folder or file")
    parser.add_argument("--tokenizer", default=None, help="prepare: a tokenizer folder (the kernel corpus's BPE)")
    parser.add_argument("--write", action="store_true", help="render the stored results into docs/data.md")
    args = parser.parse_args(argv)
    if args.what == "throughput":
        folder = args.folder or synthetic_folder(CORPORA / "synthetic-40mb", 20_000_000)
        _store("throughput", throughput(folder, args.context, args.batch, args.batches, args.repeats))
    elif args.what == "memory":
        _store("memory", memory(args.big_gb, args.keep))
    elif args.what == "resume":
        _store("resume", resume(10**9, args.context, args.batch, args.repeats))
    elif args.what == "prepare":
        if args.source is None or args.tokenizer is None:
            parser.error("prepare needs --source and --tokenizer")
        _store("prepare", prepare_rates(args.source, args.tokenizer, args.repeats))
    elif args.what == "encoders":
        if args.source is None or args.tokenizer is None:
            parser.error("encoders needs --source and --tokenizer")
        _store("encoders", encoders(args.source, Path(args.tokenizer), 20.0))
    elif args.what == "kernel":
        _store("kernel", kernel_result(args.folder or CORPORA / "linux-6.12-bpe32k"))
    if args.write:
        from link import write_between

        text = render(json.loads(RESULTS.read_text()))
        write_between(DOC, *MARKERS, text)
        print(text)


if __name__ == "__main__":
    main()
