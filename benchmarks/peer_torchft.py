"""Peer comparison: torchft's DiLoCo against adloco's plain DiLoCo on the same 2-replica gloo setup.

    pip install 'adloco[torchft]'                     # torchft 0.2 (install after the CPU torch pin)
    python benchmarks/peer_torchft.py --write         # 192,000 tokens, H = 10, 5 runs per side (~10 min)
    python benchmarks/peer_torchft.py --tokens 19200 --repeats 1   # a quick look (~1 min)

Both sides train the same model (adloco's tiny LLaMA preset from the same seed), read the same per-worker
token streams (adloco's Corpus/TokenStream with the seeds adloco's DiLoCo gives workers 0 and 1), take the same
inner steps (adloco's Worker: AdamW, clipping, the same learning-rate schedule) and use the same outer
optimizer (SGD with the method's lr, momentum and Nesterov setting) every H steps. What differs is only the
synchronisation: adloco's DistributedCommunicator under torchrun, or torchft's ``DiLoCo`` wrapper with its
``Manager``, a lighthouse process and a reconfigurable ``ProcessGroupGloo`` (one replica group of one rank per
replica). Each side runs as two processes on loopback with one thread each; adloco's run writes metrics.jsonl
but no TensorBoard events (``run.trackers=[]``), as the torchft side logs nothing.

Reported: training tokens/s of each (median of the repeats, run alternately), their ratio against the target
(adloco >= torchft), and how far apart the final parameters are. Results go to
benchmarks/results/peer_torchft.json; ``--write`` also puts the table into docs/results/link-and-peers.md between the
torchft markers. If torchft cannot be imported the script says why, prints "skipped" and exits 0; a run that
fails is an error (exit 1).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from common import free_port
from link import machine, publish

from adloco.config.input import layered

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results" / "link-and-peers.md"
RESULTS = ROOT / "benchmarks" / "results" / "peer_torchft.json"
BEGIN, END = "<!-- torchft:begin -->", "<!-- torchft:end -->"
STREAM_SEED_STRIDE = 1_000_003  # adloco.cluster.cluster: worker w of seed s reads stream s * stride + w

# The run both sides share (adloco's keys); the torchft side reads its settings from the same config object.
BASE = [
    "method=diloco",
    "workers=2",
    "threads=1",
    "eval.blocks=32",
    "eval.final_full=false",
    "run.progress=false",
    "run.plots=false",
    "run.trackers=[]",
    "checkpoint.every=1000000",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # RUST_LOG: torchft's Rust side logs every quorum at info level otherwise.
    env.update({"PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo", "RUST_LOG": "warn"})
    return env


def overrides_for(tokens: int, sync_every: int, seed: int, extra: list[str] | None = None) -> list[str]:
    """The adloco overrides both sides run; eval.every beyond the run: only the final evaluation."""
    base = [*BASE, f"total_tokens={tokens}", f"sync_every={sync_every}", f"seed={seed}", "eval.every=1000000"]
    return [*base, *(extra or [])]


def run_adloco(overrides: list[str], root: Path, name: str, timeout_s: float) -> dict[str, Any]:
    """adloco's DiLoCo on 2 ranks under torchrun; tokens/s over the training rounds and the final parameters."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={free_port()}", "-m", "adloco", "train"]
    command += layered(overrides, [f"run.root={root}", f"run.name={name}"])
    done = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=timeout_s, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"adloco failed: {done.stderr.strip()[-2000:]}")
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r["kind"] == "round"]
    final = next(r for r in records if r["kind"] == "final")
    if len(rounds) < 2:
        raise RuntimeError(f"adloco ran {len(rounds)} round(s); the timing needs at least 2 (raise --tokens)")
    # From the end of the first round (as on the torchft side) to the end of the last, without the
    # evaluation of the last round (the final one, on the same blocks) and the export.
    seconds = float(rounds[-1]["seconds"]) - float(rounds[-1].get("eval_seconds") or 0.0)
    seconds -= float(rounds[0]["seconds"]) - float(rounds[0].get("eval_seconds") or 0.0)
    timed = int(rounds[-1]["tokens"]) - int(rounds[0]["tokens"])
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load would clutter the benchmark's output
    model = AutoModelForCausalLM.from_pretrained(root / name / "final")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {
        "tokens": timed,
        "seconds": seconds,
        "tokens_per_second": timed / seconds,
        "val_loss": min(float(v) for v in final["val_loss"].values()),
        "params": params,
    }


def _task(config: Any) -> Any:
    """adloco's language-modelling task for ``config``, built as ``adloco train`` builds it."""
    from adloco.data import build_tokenizer, load_corpus, source_from_config, training_texts
    from adloco.workers.tasks import build_task

    source = source_from_config(config.data)
    tokenizer = build_tokenizer(config.data, training_texts(config.data, source))
    return build_task(
        config.task,
        config.model,
        config.data,
        config.seed,
        tokenizer,
        lambda context: load_corpus(config.data, tokenizer, context, source),
    )


def replica_main(replica: int, lighthouse: str, overrides: list[str], out: Path) -> None:
    """One torchft replica (a replica group of one rank) hosting adloco's worker ``replica``."""
    from datetime import timedelta

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from adloco.algorithms.schedules import inner_lr
    from adloco.config import build_config
    from adloco.workers.worker import Worker

    config = build_config(overrides=overrides)
    torch.set_num_threads(config.threads or 1)
    task = _task(config)
    model = task.build_model(config.seed)  # trainer 0 of adloco's DiLoCo starts from config.seed
    stream = task.stream(config.seed * STREAM_SEED_STRIDE + replica, worker=replica, workers=2)
    worker = Worker(replica, model, config.inner, stream, task.loss)
    outer = torch.optim.SGD(
        model.parameters(), lr=config.outer.lr, momentum=config.outer.momentum, nesterov=bool(config.outer.nesterov)
    )

    store_port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            worker.optimizer.load_state_dict(state["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": worker.optimizer.state_dict()},
        min_replica_size=2,
        use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        replica_id=f"adloco_peer_{replica}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        # Both replicas start from the same seeded weights. With init_sync the first quorum (after H steps)
        # would let replica 1 "heal" from replica 0's mid-round state, so its Δ would be replica 0's.
        init_sync=False,
    )
    context = task.context
    per_step = 2 * config.batch.size * context
    steps = math.ceil(config.total_tokens / per_step)
    if steps < 2 * config.sync_every:
        raise SystemExit(f"{steps} steps: the timing needs at least 2 rounds of {config.sync_every} (raise --tokens)")
    b = config.batch.size
    inner = config.inner
    with DiLoCo(manager, [model], worker.optimizer, outer, sync_every=config.sync_every, pin_memory=False):
        start = time.perf_counter()
        for step in range(steps):
            lr = inner_lr(step, step * per_step / config.total_tokens, inner.lr, inner.min_lr, inner.warmup_steps)
            worker.compute_gradients(b, config.batch.b_cap)
            worker.step(lr)  # torchft's post-step hook syncs every H steps
            if step + 1 == config.sync_every:
                # The clock starts after the first round on both sides: it holds the first quorum, which
                # waits for the later-started replica (adloco's ranks meet in init_process_group instead).
                start = time.perf_counter()
        seconds = time.perf_counter() - start
    timed = (steps - config.sync_every) * per_step
    result = {"tokens": timed, "seconds": seconds, "tokens_per_second": timed / seconds}
    if replica == 0:
        theta = [p.detach().clone() for p in model.parameters()]
        result["val_loss"] = task.evaluate(task.build_model(config.seed), theta, config.eval.blocks).loss
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "params.pt")
    (out / f"replica{replica}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
    del store


def run_torchft(overrides: list[str], root: Path, timeout_s: float) -> dict[str, Any]:
    """Two torchft replicas and a lighthouse; tokens/s (the slower replica) and replica 0's final parameters."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    # Its own address names this host; the replicas reach it on loopback, as everything else here.
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    root.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for replica in (0, 1):
            command = [sys.executable, __file__, "--replica", str(replica), "--lighthouse", address]
            command += ["--out", str(root), "--", *overrides]
            procs.append(
                subprocess.Popen(
                    command, env=_env(), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        deadline = time.monotonic() + timeout_s
        for replica, proc in enumerate(procs):
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"torchft replica {replica} exited {proc.returncode}: {err.strip()[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        lighthouse.shutdown()
    results = [json.loads((root / f"replica{r}.json").read_text()) for r in (0, 1)]
    seconds = max(r["seconds"] for r in results)
    return {
        "tokens": results[0]["tokens"],
        "seconds": seconds,
        "tokens_per_second": results[0]["tokens"] / seconds,
        "val_loss": results[0]["val_loss"],
        "params": torch.load(root / "params.pt"),
    }


def agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How far two parameter sets are apart (names present in both; tied weights appear once)."""
    names = sorted(set(a) & set(b))
    if not names:
        raise RuntimeError("the two runs share no parameter names")
    diff = torch.cat([(a[n].float() - b[n].float()).reshape(-1) for n in names])
    ref = torch.cat([a[n].float().reshape(-1) for n in names])
    return {
        "tensors": len(names),
        "bit_identical": all(torch.equal(a[n], b[n]) for n in names),
        "max_abs_diff": float(diff.abs().max()),
        "relative_l2": float(diff.norm() / ref.norm()),
    }


def markdown(report: dict[str, Any]) -> str:
    """The section docs/results/link-and-peers.md shows: provenance, the throughput table, agreement and the target."""
    v, a = report["versions"], report["agreement"]
    tps, median = report["tokens_per_second"], report["median_tokens_per_second"]
    ratio = report["median_ratio"]
    head = (
        f"Measured {report['date']} with `{report['command']}`: adloco {v['adloco']}, torchft {v['torchft']}, "
        f"torch {v['torch']}, Python {v['python']}; {report['machine']}. Both sides: plain DiLoCo, 2 processes × "
        f"1 thread on loopback (gloo), H = {report['sync_every']}, {report['tokens']:,} tokens, seed "
        f"{report['seed']}; {report['repeats']} runs per side, alternating. Tokens/s from the end of the first "
        "round to the end of the last."
    )
    sides = {"adloco": "adloco (torchrun, DistributedCommunicator)", "torchft": "torchft (Manager + DiLoCo wrapper)"}
    rows = [
        "| side | tokens/s per run | median tokens/s | final val loss |",
        "| --- | --- | --- | --- |",
        *(
            f"| {label} | {', '.join(f'{x:,.0f}' for x in tps[side])} | {median[side]:,.0f} "
            f"| {report['val_loss'][side]:.4f} |"
            for side, label in sides.items()
        ),
    ]
    same = (
        "bit-identical"
        if a["bit_identical"]
        else f"max abs diff {a['max_abs_diff']:.3g}, relative L2 {a['relative_l2']:.3g}"
    )
    repeat = "bit-identical" if report["adloco_repeatable"] else "not bit-identical"
    tail = [
        f"Throughput adloco / torchft: {ratio:.2f}× (median over median; per pair of runs "
        f"{', '.join(f'{r:.2f}' for r in report['ratio_adloco_over_torchft'])}).",
        f"Final parameters, adloco vs torchft ({a['tensors']} tensors): {same}; adloco run to run: {repeat}.",
        "",
        f"Target: throughput ≥ torchft's on the same setup: **{'met' if ratio >= 1.0 else 'not met'}** ({ratio:.2f}×).",
    ]
    return "\n\n".join([head, "\n".join(rows), "\n".join(tail)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=192_000, help="training tokens over both workers")
    parser.add_argument("--sync-every", type=int, default=10, help="H")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="runs per side, alternating; medians are reported")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before one run is killed")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peer_torchft", help="where the runs go")
    parser.add_argument("--json", type=Path, default=RESULTS, help="results file (default benchmarks/results/)")
    parser.add_argument("--write", action="store_true", help="put the table into --doc between the torchft markers")
    parser.add_argument("--doc", type=Path, default=DOC, help="default docs/results/link-and-peers.md")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)  # internal: run one torchft replica
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="further adloco overrides for both sides (e.g. model.context=16)")
    args = parser.parse_args(argv)
    if args.replica is not None:
        replica_main(args.replica, args.lighthouse, args.extra, Path(args.out))
        return 0
    if args.tokens <= 0 or args.repeats < 1 or args.sync_every < 1:
        parser.error("--tokens, --repeats and --sync-every must be positive")
    if args.write and not (args.doc.exists() and BEGIN in args.doc.read_text() and END in args.doc.read_text()):
        parser.error(f"--write: {args.doc} has no {BEGIN} ... {END} markers")
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process
    try:
        import torchft  # noqa: F401 - the Python side must load
        from torchft._torchft import LighthouseServer  # noqa: F401 - and the compiled part
    except Exception as error:  # any import failure means "cannot compare here", with the reason
        print(f"skipped: torchft cannot be imported: {type(error).__name__}: {error}")
        return 0
    import adloco

    overrides = overrides_for(args.tokens, args.sync_every, args.seed, args.extra)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"adloco": [], "torchft": []}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for repeat in range(args.repeats):
            try:
                runs["adloco"].append(run_adloco(overrides, Path(tmp), f"adloco{repeat}", args.timeout))
                print(f"adloco  run {repeat}: {runs['adloco'][-1]['tokens_per_second']:,.0f} tokens/s", flush=True)
                runs["torchft"].append(run_torchft(overrides, Path(tmp) / f"torchft{repeat}", args.timeout))
                print(f"torchft run {repeat}: {runs['torchft'][-1]['tokens_per_second']:,.0f} tokens/s", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"error: {str(error).strip().splitlines()[-1] if str(error).strip() else error}", file=sys.stderr)
                return 1
    median = {side: statistics.median(r["tokens_per_second"] for r in runs[side]) for side in runs}
    ratios = [
        a["tokens_per_second"] / t["tokens_per_second"] for a, t in zip(runs["adloco"], runs["torchft"], strict=True)
    ]
    report = {
        "date": date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/peer_torchft.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {
            "adloco": adloco.__version__,
            "torchft": importlib.metadata.version("torchft"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": machine(),
        "tokens": args.tokens,
        "sync_every": args.sync_every,
        "seed": args.seed,
        "repeats": args.repeats,
        "overrides": overrides,
        "tokens_per_second": {side: [r["tokens_per_second"] for r in runs[side]] for side in runs},
        "median_tokens_per_second": median,
        "ratio_adloco_over_torchft": ratios,
        "median_ratio": median["adloco"] / median["torchft"],
        "target_met": median["adloco"] >= median["torchft"],
        "val_loss": {side: runs[side][0]["val_loss"] for side in runs},
        "agreement": agreement(runs["adloco"][0]["params"], runs["torchft"][0]["params"]),
        "adloco_repeatable": agreement(runs["adloco"][0]["params"], runs["adloco"][-1]["params"])["bit_identical"],
    }
    publish(report, markdown(report), args.json, args.doc if args.write else None, (BEGIN, END))
    return 0


if __name__ == "__main__":
    sys.exit(main())
