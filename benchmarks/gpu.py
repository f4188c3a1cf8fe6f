"""adloco against a bare PyTorch loop on one GPU: tokens/s, MFU and peak memory at ``llama-125m``.

    python benchmarks/gpu.py [--write]     # a CUDA GPU: llama-125m, bf16, compiled; about 8 minutes
    python benchmarks/gpu.py --quick       # the same code paths on the CPU in seconds (what the test suite runs)
    python benchmarks/gpu.py --cpu --write # this CPU's target: medium (20 M), one worker, interleaved repeats

Rows, each in a process of its own, all on the same token folder (a synthetic prepared one the script writes,
or --data DIR), the same model, batch and kernels:

- ``bare loop``: written here, no adloco: the model, fused AdamW, bf16 autocast, ``torch.compile``, windows read
  with ``TokenWindows``; it also times how much of a step waits for data;
- ``adloco diloco, 1 worker``, ``adloco ddp, 1 rank`` and ``adloco diloco, 4 stacked workers`` (a quarter of the
  batch each): ``adloco train`` with the same settings, its tokens/s and MFU from the round records after the first
  (which compiles).

``--write`` appends the call to benchmarks/results/gpu.json and renders docs/gpu.md's table. The quick mode is
not a measurement (tiny model, fp32, eager): it keeps the script working between the rare days a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, environment

RESULTS = ROOT / "benchmarks" / "results" / "gpu.json"
DOC = ROOT / "docs" / "gpu.md"
MARKERS = ("<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->")
CPU_MARKERS = ("<!-- cpu-bench:begin -->", "<!-- cpu-bench:end -->")


def settings(mode: str) -> dict:
    """The shared settings of every row: ``gpu`` (llama-125m, bf16, compiled), ``quick`` (tiny, a few steps) or
    ``cpu`` (medium, fp32, eager: the target for a CPU, adloco at least 0.97x the bare loop)."""
    if mode == "quick":
        return {"preset": "tiny", "context": 64, "batch": 8, "steps": 12, "warmup": 3, "precision": "fp32",
                "compile": False, "device": "cpu", "tokens": 200_000, "vocab": 512, "repeats": 1}  # fmt: skip
    if mode == "cpu":
        return {"preset": "medium", "context": 256, "batch": 8, "steps": 20, "warmup": 4, "precision": "fp32",
                "compile": False, "device": "cpu", "tokens": 2_000_000, "vocab": 512, "repeats": 3}  # fmt: skip
    return {"preset": "llama-125m", "context": 1024, "batch": 32, "steps": 150, "warmup": 30, "precision": "bf16",
            "compile": True, "device": "cuda", "tokens": 60_000_000, "vocab": 32768, "repeats": 1}  # fmt: skip


def token_folder(path: Path, tokens: int, vocab: int) -> Path:
    """A prepared folder of random ids under a word-level tokenizer of ``vocab`` entries (a model's speed does not
    depend on the text, but its head does on the vocabulary: 32k, as a BPE of the recipe's)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from adloco.data.token_files import Manifest, ShardRecord, tokenizer_digest, write_manifest, write_tokens

    if (path / "manifest.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0").save_pretrained(str(path / "tokenizer"))
    manifest = Manifest(dtype="uint16", vocab_size=vocab, eot_id=0, source={"dataset": "random"}, settings={},
                        tokenizer={"type": "hf", "origin": "random words", "dir": "tokenizer",
                                   "sha256": tokenizer_digest(path / "tokenizer")})  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    for split, count in (("train", tokens), ("val", 200_000)):
        ids = torch.randint(0, vocab, (count,), generator=rng, dtype=torch.int32).numpy().astype("uint16")
        digest, largest = write_tokens(path / f"{split}_000000.bin", [ids])
        (manifest.train if split == "train" else manifest.val).append(
            ShardRecord(f"{split}_000000.bin", count, 1, digest, largest)
        )
    manifest.complete = True
    write_manifest(path, manifest)
    return path


def bare_loop(folder: Path, s: dict) -> dict:
    """The training step without adloco: tokens/s, MFU, peak memory and the share of a step spent reading data."""
    from adloco.data import TokenWindows
    from adloco.models.build import build_model, flops_per_token_of, next_token_loss, preset_config
    from adloco.models.precision import autocast_for, peak_flops

    device = torch.device(s["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    from adloco.data.token_files import read_manifest

    vocab = read_manifest(folder).vocab_size
    model = build_model(preset_config(s["preset"], vocab, s["context"]), seed=0).to(device)
    from adloco.models.precision import adamw_kernel

    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, **adamw_kernel(device))
    step_loss = torch.compile(lambda x, y: next_token_loss(model, x, y)) if s["compile"] else None
    windows = TokenWindows(str(folder), s["context"])
    batches = iter(windows.sampler(s["batch"]))
    waiting, started = 0.0, 0.0
    for step in range(s["warmup"] + s["steps"]):
        if step == s["warmup"]:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started, waiting = time.perf_counter(), 0.0
        read = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in windows.__getitems__(next(batches)))
        waiting += time.perf_counter() - read
        with autocast_for(s["precision"], device):
            loss = step_loss(inputs, targets) if step_loss else next_token_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    rate = s["steps"] * s["batch"] * s["context"] / seconds
    peak = peak_flops(device, s["precision"], True)
    per_token = flops_per_token_of(model, s["context"])
    return {"tokens_per_s": round(rate), "mfu": None if peak is None else rate * per_token / peak,
            "peak_memory_mib": _peak_memory(device), "data_wait_share": round(waiting / seconds, 4)}  # fmt: skip


def _peak_memory(device: torch.device) -> float | None:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return None


ROWS = {  # name: adloco train overrides besides the shared ones
    "adloco diloco, 1 worker": ["method=diloco", "workers=1"],
    "adloco ddp, 1 rank": ["method=ddp", "workers=1"],
    "adloco diloco, 4 stacked workers": ["method=diloco", "workers=4"],
}


def adloco_row(folder: Path, s: dict, overrides: list[str], root: Path, name: str) -> dict:
    """``adloco train`` with the row's settings; figures from its rounds after the first."""
    workers = 4 if "workers=4" in overrides else 1
    per_worker = s["batch"] // workers
    # whole rounds only: the budget is a multiple of them, and the first (compilation, probes) is not timed
    steps_per_round = (s["warmup"] + s["steps"]) // 3 if s["device"] == "cpu" else 50
    budget = (s["warmup"] + s["steps"]) * s["batch"] * s["context"]
    command = [sys.executable, "-m", "adloco", "train", f"data.dataset={folder}", "data.verify=size",
               f"model.preset={s['preset']}", f"model.context={s['context']}", f"precision={s['precision']}",
               f"compile={str(s['compile']).lower()}", f"device={s['device']}", f"batch.size={per_worker}",
               f"batch.memory.b_max={per_worker}", f"sync_every={steps_per_round}", f"total_tokens={budget}",
               "inner.lr=6e-4", "eval.every=100000", "eval.final_full=false", "eval.blocks=2",
               "run.progress=false", "run.save_final=false", "run.plots=false", "run.trackers=[]",
               f"run.root={root}", f"run.name={name}", *overrides]  # fmt: skip
    if s["device"] == "cpu":  # a nominal peak, so that the MFU path runs; in this process (a CPU runs one thing)
        from adloco.config import build_config
        from adloco.run.training import train

        train(build_config(overrides=[*command[4:], "run.peak_tflops=0.1"]))
    else:  # a process of its own: the GPU's memory and compiled kernels start clean for every row
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line]
    every = [r for r in records if r["kind"] == "round"]
    rounds = every[1:] or every
    rates = [  # the round's tokens over its training time (its evaluation, if any, left out)
        (r["tokens"] - before["tokens"]) / (r["round_seconds"] - r["eval_seconds"])
        for before, r in zip([{"tokens": 0}, *every], every, strict=False)
        if r in rounds
    ]
    memory = [m.get("cuda_peak_allocated_mib") for r in rounds for m in r["memory"] or []]
    mfus = [r["mfu"] for r in rounds if r.get("mfu") is not None]
    return {"tokens_per_s": round(statistics.median(rates)),
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_memory_mib": max((m for m in memory if m is not None), default=None)}  # fmt: skip


def measure(mode: str, data: Path | None) -> dict:
    """Every row of the mode, the rows taken in turn ``repeats`` times (so that a slow spell of the machine falls on
    all of them); each row's median."""
    s = settings(mode)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu.py measures a CUDA GPU; none is here (use --quick or --cpu on a CPU)")
    rows = ROWS
    if mode == "cpu":  # adloco's default (its stacked model) and the transformers module the bare loop runs
        one = ROWS["adloco diloco, 1 worker"]
        rows = {"adloco diloco, 1 worker": one, "adloco diloco, 1 worker, HF module": [*one, "batched_workers=false"]}
    runs: dict[str, list[dict]] = {name: [] for name in ["bare loop", *rows]}
    with tempfile.TemporaryDirectory() as scratch:
        folder = data or token_folder(Path(scratch) / "tokens", s["tokens"], s["vocab"])
        for repeat in range(s["repeats"]):
            runs["bare loop"].append(bare_loop(folder, s))
            for name, overrides in rows.items():
                label = f"{name.replace(' ', '_').replace(',', '')}_{repeat}"
                runs[name].append(adloco_row(folder, s, overrides, Path(scratch) / "runs", label))
    result = {name: _median_row(taken) for name, taken in runs.items()}
    bare = result["bare loop"]["tokens_per_s"]
    for row in result.values():
        row["of_bare_loop"] = round(row["tokens_per_s"] / bare, 3)
    device = torch.cuda.get_device_name(0) if s["device"] == "cuda" else "CPU"
    return {"mode": mode, "settings": s, "device": device, "rows": result, "environment": environment()}


def _median_row(taken: list[dict]) -> dict:
    """The median of each figure over a row's repeats (the runs' tokens/s kept too)."""
    row = {}
    for key in taken[0]:
        values = [t[key] for t in taken if t[key] is not None]
        row[key] = statistics.median(values) if values else None
    row["tokens_per_s"] = round(row["tokens_per_s"])
    row["runs_tokens_per_s"] = [t["tokens_per_s"] for t in taken]
    return row


def render(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"{result['device']}, `{s['preset']}`, context {s['context']}, batch {s['batch']}, {s['precision']}"
        f"{', compiled' if s['compile'] else ''}; {s['steps']} timed steps after {s['warmup']}; the median of "
        f"{s['repeats']} runs each, taken in turn."
        + (" No MFU on a CPU: its peak is not measured here." if result["device"] == "CPU" else ""),
        "",
        "| run | tokens/s | × bare loop | MFU | peak memory (MiB) | waiting for data |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    nominal = result["device"] == "CPU"  # the MFU path ran against a nominal peak there, not a measured one
    for name, row in result["rows"].items():
        mfu = "—" if row["mfu"] is None or nominal else f"{row['mfu']:.1%}"
        memory = "—" if row["peak_memory_mib"] is None else f"{row['peak_memory_mib']:,.0f}"
        wait = f"{row['data_wait_share']:.1%}" if "data_wait_share" in row else "—"
        lines.append(f"| {name} | {row['tokens_per_s']:,} | {row['of_bare_loop']:.3f} | {mfu} | {memory} | {wait} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the same code paths on the CPU, in seconds")
    mode.add_argument("--cpu", action="store_true", help="this CPU's target: medium, one worker, repeats in turn")
    parser.add_argument("--data", type=Path, default=None, help="a prepared token folder (default: synthetic)")
    parser.add_argument("--write", action="store_true", help="append to results/gpu.json and render docs/gpu.md")
    args = parser.parse_args(argv)
    result = measure("quick" if args.quick else "cpu" if args.cpu else "gpu", args.data)
    text = render(result)
    print(text)
    if args.write:
        from link import write_between

        calls = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
        RESULTS.write_text(json.dumps([*calls, result], indent=2) + "\n")
        write_between(DOC, *(CPU_MARKERS if result["mode"] == "cpu" else MARKERS), text)
    return result


if __name__ == "__main__":
    main()
