"""The 2025-26 frontier at equal tokens: AdamW-DiLoCo against MuLoCo (Muon inner steps), each at its own outer
settings; dense fp32 against fp4 with error feedback and top-k at 1 % and 3 % with 2-bit values; outer Adam.

    python benchmarks/frontier.py --write                         # both corpora, seed 0, the anchor budget
    python benchmarks/frontier.py --corpus python --seeds 0,1     # one corpus, two seeds
    python benchmarks/frontier.py --only muon,adamw --reuse       # some runs; keep those already stored

Every run is 4 workers × batch 3, H = 10 (the defaults), 1.536 M training tokens, one thread, two runs at a
time. Results go to benchmarks/results/frontier.json (runs already there are kept with --reuse, so the
benchmark can be run in parts) and, with --write, to docs/results/frontier.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import ANCHOR_TOKENS, ROOT, describe, environment, train_run
from link import corpus_overrides

from adloco.checkpoint import atomic_write_bytes

RESULTS = ROOT / "benchmarks" / "results" / "frontier.json"
PAPER_OUTER = ["outer.lr=0.7", "outer.momentum=0.6"]  # MuLoCo's reported outer Nesterov settings
VARIANTS: dict[str, list[str]] = {
    "adamw": [],  # our DiLoCo default: outer lr 1.0, Nesterov momentum 0.5
    "adamw-paper-outer": PAPER_OUTER,
    "muon": ["inner.optimizer=muon"],
    "muon-paper-outer": ["inner.optimizer=muon", *PAPER_OUTER],
    "fp4-ef": ["codec.name=fp4-e2m1", "codec.error_feedback=true"],
    "topk-1%": ["codec.name=topk", "codec.density=0.01"],
    "topk-3%": ["codec.name=topk", "codec.density=0.03"],
    "outer-adam": ["outer.optimizer=adam"],
    "topk-3%-8bit": ["codec.name=topk", "codec.density=0.03", "codec.value_bits=8"],
    # SparseLoCo's structure: no outer momentum, a decayed error-feedback accumulator in its place
    "sparseloco-3%": ["codec.name=topk", "codec.density=0.03", "codec.feedback_decay=0.95", "outer.momentum=0"],
    "muon-topk-1%": ["inner.optimizer=muon", "codec.name=topk", "codec.density=0.01"],
    "muon-topk-3%": ["inner.optimizer=muon", "codec.name=topk", "codec.density=0.03"],
    "ddp-muon": ["method=ddp", "inner.optimizer=muon"],  # Muon's own every-step baseline
}


def _key(corpus: str, seed: int, name: str) -> str:
    return f"{corpus}/seed{seed}/{name}"


def _run(corpus: str, seed: int, name: str, tokens: int, root: Path, data: list[str]) -> tuple[str, dict]:
    overrides = ["method=diloco", f"seed={seed}", f"total_tokens={tokens}", "threads=1", "eval.every=20",
                 *data, *VARIANTS[name]]  # fmt: skip
    summary = train_run(f"{corpus}-{seed}-{name}", overrides, root, timeout=7200)
    summary.pop("batches", None)  # the curve stays: bytes and seconds to a target loss are read from it
    summary["overrides"] = [o.replace(f"{ROOT}/", "") for o in summary["overrides"]]  # no machine's paths
    print(
        f"{corpus} seed {seed} {name}: val loss {summary['val_loss']:.4f}, {summary['bytes'] / 1e6:,.1f} MB", flush=True
    )
    return _key(corpus, seed, name), summary


def _load() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}


def _save(report: dict[str, Any], key: str, summary: dict) -> None:
    """Add one run to the stored results as they are on disk now (another invocation may have added its own)."""
    stored = _load()
    if stored.get("tokens") != report["tokens"]:
        stored = {"runs": {}}
    stored["runs"][key] = report["runs"][key] = summary
    stored.update(tokens=report["tokens"], environment=environment())
    report.update(stored)
    atomic_write_bytes(RESULTS, (json.dumps(stored, indent=1) + "\n").encode())


def table(report: dict[str, Any], corpus: str) -> str:
    """One corpus: each variant's val loss (mean over its seeds) against AdamW-DiLoCo's over the same seeds, and
    its bytes."""
    runs: dict[str, dict[str, dict]] = {}
    for key, run in report["runs"].items():
        where, seed, name = key.split("/", 2)
        if where == corpus:
            runs.setdefault(name, {})[seed] = run
    base = runs.get("adamw", {})
    if not base:
        return ""
    lines = ["| run | overrides | seeds | val loss | vs AdamW-DiLoCo, same seeds | bytes sent | fewer than fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name in [n for n in VARIANTS if n in runs]:
        done = runs[name]
        seeds = [s for s in done if s in base] or list(done)
        loss = sum(done[s]["val_loss"] for s in done) / len(done)
        matched = sum(done[s]["val_loss"] for s in seeds) / sum(base[s]["val_loss"] for s in seeds) - 1
        losses = ", ".join(f"{done[s]['val_loss']:.4f}" for s in sorted(done))
        first = next(iter(done.values()))
        lines.append(
            f"| {name} | `{' '.join(VARIANTS[name]) or '(defaults)'}` | {len(done)} | {loss:.4f} ({losses}) "
            f"| {100 * matched:+.2f} % | {first['bytes'] / 1e6:,.1f} MB "
            f"| {next(iter(base.values()))['bytes'] / first['bytes']:,.1f}× |"
        )
    return "\n".join(lines)


def write_doc(report: dict[str, Any]) -> None:
    doc = ROOT / "docs" / "results" / "frontier.md"
    text = doc.read_text() if doc.exists() else "# The frontier methods, measured\n"
    begin, end = "<!-- frontier: begin -->", "<!-- frontier: end -->"
    body = [begin, f"Measured {describe(report['environment'])}; {report['tokens']:,} training tokens per run.", ""]
    for corpus, title in (("shakespeare", "Tiny Shakespeare"), ("python", "Python standard library")):
        rows = table(report, corpus)
        if rows:
            body += [f"**{title}**", "", rows, ""]
    body.append(end)
    block = "\n".join(body)
    text = (
        text[: text.index(begin)] + block + text[text.index(end) + len(end) :] if begin in text else text + "\n" + block
    )
    doc.write_text(text + ("" if text.endswith("\n") else "\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="shakespeare,python", help="shakespeare, python, or both (comma list)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--tokens", type=int, default=ANCHOR_TOKENS)
    parser.add_argument("--reuse", action="store_true", help="keep runs already stored for these settings")
    parser.add_argument("--write", action="store_true", help="write the tables into docs/results/frontier.md")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    report = _load()
    if report.get("tokens") not in (None, args.tokens):
        report = {"runs": {}}  # another budget: the stored runs do not compare
    report["tokens"] = args.tokens
    jobs = []
    for corpus in args.corpus.split(","):
        data = [] if corpus == "shakespeare" else corpus_overrides(corpus)[0]
        for seed in (int(s) for s in args.seeds.split(",")):
            jobs += [
                (corpus, seed, n, data) for n in names if not (args.reuse and _key(corpus, seed, n) in report["runs"])
            ]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(_run, c, s, n, args.tokens, Path(tmp), d) for c, s, n, d in jobs]
        for future in futures:
            _save(report, *future.result())
    for corpus in ("shakespeare", "python"):
        print(corpus, "\n" + table(report, corpus))
    if args.write:
        write_doc(report)


if __name__ == "__main__":
    main()
