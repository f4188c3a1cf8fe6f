"""What the hooks cost: the same training loop bare, with ``adloco.DiLoCo`` and with torchft's ``DiLoCo``.

    python benchmarks/own_loop_cost.py --write      # H = 10 and 50, 3 interleaved repeats (~25 min on 2 cores)
    python benchmarks/own_loop_cost.py --quick      # a tiny model, H = 2, a few steps, one repeat (the test's)

Every repeat is one job of 2 ranks of one thread each under ``python -m torch.distributed.run`` on loopback
(gloo) that runs the three variants in turn for each H (bare, adloco, torchft, then the next H), each from a fresh
model and optimizer, the ranks meeting at a barrier before each. All three run the very same loop: a LLaMA-like
transformer of 3.3 M parameters (4 blocks of width 256, MLP 688, 8 heads, rotary positions, RMSNorm, SwiGLU and
LLaMA's tensors, a byte vocabulary; written here in plain torch so that a rank starts in seconds), each rank
reading its own windows of the bundled Tiny Shakespeare (seed = rank, cut before the clock starts), AdamW (lr 1e-3,
weight decay 0.1) and clipping at norm 1. The variants differ only in what wraps the optimizer:

- ``bare``: nothing; the ranks never talk (the floor);
- ``adloco``: ``adloco.DiLoCo(model, optimizer, sync_every=H)`` as a context manager (its NaN/inf guard on);
- ``torchft``: torchft's ``DiLoCo`` with a ``Manager`` (a ``ProcessGroupGloo``, one replica group of one rank per
  torchrun rank, a Lighthouse of the run's own on rank 0), set up as benchmarks/peer_torchft.py sets it up, and
  the same outer SGD (lr 1.0, momentum 0.5, Nesterov: adloco's DiLoCo defaults). Both sides end on the same bits.

Every inner step is timed on its own: the whole step (forward to the end of ``optimizer.step()``) and
``optimizer.step()`` alone, where the wrappers' hooks run (the guard each step, the sync every H steps). The first
round is a warm-up and not counted (it holds torchft's first quorum). Reported per side and H, medians over both
ranks: a step that does not sync; the hooks' cost a step (``optimizer.step()`` less the bare loop's, the same
AdamW); a sync's extra time (its ``optimizer.step()`` on the rank that reached it last, the other having waited for
it, less an ordinary one); what hooks and sync add to a round against H bare steps; and a round's measured time
against the bare loop's (this also holds each round's wait for the slower rank, and the runs' spread).
Results go to benchmarks/results/own_loop_cost.json; ``--write`` also renders them into docs/own-loop.md between
the own-loop-cost markers. Where torchft cannot be imported its rows say so and the rest still runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import ROOT, torchrun
from torch import nn

RESULTS = ROOT / "benchmarks" / "results" / "own_loop_cost.json"
DOC = ROOT / "docs" / "own-loop.md"
MARKERS = ("<!-- own-loop-cost:begin -->", "<!-- own-loop-cost:end -->")
SIDES = ("bare", "adloco", "torchft")
LABELS = {"bare": "bare loop", "adloco": "adloco.DiLoCo", "torchft": "torchft DiLoCo"}
OUTER = {"lr": 1.0, "momentum": 0.5, "nesterov": True}  # adloco's DiLoCo defaults, given to torchft's outer SGD

# (blocks, width, heads, MLP width, context, batch): the measurement, and --quick's tiny one.
FULL = {"layers": 4, "width": 256, "heads": 8, "mlp": 688, "context": 128, "batch": 8}
QUICK = {"layers": 1, "width": 32, "heads": 2, "mlp": 64, "context": 16, "batch": 2}


# -- the model: LLaMA's layout (HF's tensors: q, k, v, o, gate, up, down and two norms per block) ------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, mlp, bias=False), nn.Linear(width, mlp, bias=False)
        self.down = nn.Linear(mlp, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class TinyLlama(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, mlp: int, context: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, mlp) for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-6)
        self.head = nn.Linear(width, vocab, bias=False)
        half = width // heads // 2
        angles = torch.outer(torch.arange(context).float(), 10000.0 ** (-torch.arange(half).float() / half))
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, dim=-1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of ``ids``."""
        x = self.embed(ids)
        cos, sin = self.cos[: ids.shape[1]], self.sin[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def parameters_of(shape: dict[str, int]) -> int:
    return sum(p.numel() for p in TinyLlama(**model_args(shape)).parameters())


def model_args(shape: dict[str, int]) -> dict[str, int]:
    return {k: shape[k] for k in ("layers", "width", "heads", "mlp", "context")}


# -- one rank of a repeat ---------------------------------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    """One torchrun rank of a repeat: every (H, side) of ``args.plan`` in turn, each a fresh model and optimizer over
    the same batches, every step timed; the times (and rank 0's final parameters) go to ``args.out``."""
    import torch.distributed as dist

    from adloco.data.sources import bundled_text

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo")  # every side: a barrier before the clock; adloco exchanges over it
    rank = dist.get_rank()
    shape = json.loads(args.shape)
    plan = json.loads(args.plan)
    data = torch.tensor(list(bundled_text("tinyshakespeare").encode()))
    generator = torch.Generator().manual_seed(rank)
    longest = max(steps for _, _, steps in plan)
    starts = torch.randint(0, len(data) - shape["context"], (longest, shape["batch"]), generator=generator)
    batches = [torch.stack([data[s : s + shape["context"]] for s in row]) for row in starts.tolist()]
    out, timed = Path(args.out), []
    for side, sync_every, steps in plan:
        model, seconds, optimizer_seconds = train(side, sync_every, batches[:steps], shape, rank)
        timed.append({"side": side, "sync_every": sync_every, "step": seconds, "optimizer": optimizer_seconds})
        if rank == 0 and side != "bare":
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
            torch.save(params, out / f"params_{side}_h{sync_every}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(timed))
    from adloco import end_process_group

    end_process_group()


def train(side: str, sync_every: int, batches: list[torch.Tensor], shape: dict, rank: int) -> tuple:
    """The loop under ``side``'s wrapper: the model, each step's seconds from its forward to the end of
    ``optimizer.step()``, and the seconds of ``optimizer.step()`` alone (the inner AdamW and the wrapper's hooks)."""
    import contextlib

    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyLlama(**model_args(shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    wrapper: Any = contextlib.nullcontext()
    finish: Any = lambda: None  # noqa: E731
    if side == "adloco":
        from adloco import DiLoCo

        wrapper = DiLoCo(model, optimizer, sync_every=sync_every)
        finish = wrapper.finish
    elif side == "torchft":
        wrapper, finish = torchft_wrapper(model, optimizer, rank, sync_every)
    dist.barrier()
    seconds, optimizer_seconds = [], []
    with wrapper:
        for batch in batches:
            start = time.perf_counter()
            model(batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            stepping = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            seconds.append(end - start)
            optimizer_seconds.append(end - stepping)
            optimizer.zero_grad()
    finish()
    dist.barrier()  # the next side starts together on both ranks
    return model, seconds, optimizer_seconds


def torchft_wrapper(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, sync_every: int) -> tuple:
    """torchft's DiLoCo around the loop, this rank one replica: its Manager, store and reconfigurable gloo group,
    and a Lighthouse of this run's own on rank 0 (a fresh one per run: no replica of an earlier run to wait for)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2) if rank == 0 else None
    address = [None if lighthouse is None else "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]]
    dist.broadcast_object_list(address, src=0)
    outer = torch.optim.SGD(model.parameters(), **OUTER)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), optimizer.load_state_dict(state["o"])),
        state_dict=lambda: {"model": model.state_dict(), "o": optimizer.state_dict()},
        min_replica_size=2,
        use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        replica_id=f"own_loop_cost_{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=address[0],
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        init_sync=False,  # both replicas start from the same seeded weights (see peer_torchft.py)
    )
    diloco = DiLoCo(manager, [model], optimizer, outer, sync_every=sync_every, pin_memory=False)
    held = [store]  # the replica group's store lives until the Manager that reads it has shut down

    def finish() -> None:
        manager.shutdown(wait=False)
        dist.barrier()  # both replicas are done with the Lighthouse
        if lighthouse is not None:
            lighthouse.shutdown()
        held.clear()

    return diloco, finish


# -- the driver ------------------------------------------------------------------------------------------------------
def torchft_missing() -> str | None:
    """Why torchft cannot run here (None: it can)."""
    try:
        import torchft.local_sgd  # noqa: F401 - the Python side
        from torchft._torchft import LighthouseServer  # noqa: F401 - and the compiled part
    except Exception as error:  # any failure to import means "cannot compare here", with the reason
        return f"{type(error).__name__}: {error}"
    return None


def run_repeat(plan: list[tuple[str, int, int]], shape: dict[str, int], out: Path, timeout: float) -> list[dict]:
    """One torchrun job that runs ``plan`` in order; every run's step times on both ranks, and the parameter files."""
    out.mkdir(parents=True)
    command, env = torchrun(2)
    env.update({"GLOO_SOCKET_IFNAME": "lo", "RUST_LOG": "warn"})
    command += [str(Path(__file__).resolve()), "--rank-loop", "--plan", json.dumps(plan)]
    command += ["--shape", json.dumps(shape), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=out)
    if done.returncode != 0:
        raise RuntimeError(f"the loops failed: {done.stderr.strip()[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return [
        {**first, "step": [first["step"], second["step"]], "optimizer": [first["optimizer"], second["optimizer"]],
         "params": out / f"params_{first['side']}_h{first['sync_every']}.pt"}
        for first, second in zip(*ranks, strict=True)
    ]  # fmt: skip


def summary(runs: list[dict], sync_every: int) -> dict[str, Any]:
    """Medians over the counted rounds (all but the first) of every run, both ranks' steps pooled:

    - ``step_ms``: a whole step that does not sync; ``optimizer_ms``: its ``optimizer.step()`` alone, where the
      hooks run (the inner AdamW is the same on every side, so the difference from the bare loop's is the hooks');
    - ``sync_extra_ms``: what a sync adds to ``optimizer.step()``, on the rank that reached it last (the smaller of
      the two ranks' times: the other one also waited for it), less a step that does not sync;
    - ``round_ms``: a round's summed step times (the same on both ranks, which leave each sync together).
    """
    plain, plain_optimizer, syncs, rounds = [], [], [], []
    for run in runs:
        for seconds, optimizer in zip(run["step"], run["optimizer"], strict=True):
            plain += _plain(seconds, sync_every)
            plain_optimizer += _plain(optimizer, sync_every)
            rounds += [math.fsum(seconds[r * sync_every : (r + 1) * sync_every]) for r in _counted(seconds, sync_every)]
        syncs += [min(ranks[(r + 1) * sync_every - 1] for ranks in run["optimizer"])
                  for r in _counted(run["optimizer"][0], sync_every)]  # fmt: skip
    optimizer_step = statistics.median(plain_optimizer)
    return {
        "step_ms": 1000 * statistics.median(plain),
        "optimizer_ms": 1000 * optimizer_step,
        "sync_extra_ms": 1000 * (statistics.median(syncs) - optimizer_step),
        "round_ms": 1000 * statistics.median(rounds),
        "steps_counted": len(plain) + 2 * len(syncs),
        "rounds_counted": len(syncs),
        "per_run_step_ms": [1000 * _median_step(r, sync_every) for r in runs],
    }


def _median_step(run: dict, sync_every: int) -> float:
    return statistics.median(x for seconds in run["step"] for x in _plain(seconds, sync_every))


def _counted(seconds: list[float], sync_every: int) -> range:
    """The rounds counted: every whole one but the first, which warms up (and holds torchft's first quorum)."""
    return range(1, len(seconds) // sync_every)


def _plain(seconds: list[float], sync_every: int) -> list[float]:
    """The steps of the counted rounds that do not sync."""
    return [s for i, s in enumerate(seconds) if i >= sync_every and (i + 1) % sync_every]


def agreement(a: Path, b: Path) -> dict[str, Any]:
    """How far the two sides' final parameters (rank 0's) are apart."""
    pa, pb = torch.load(a), torch.load(b)
    diff = max(float((pa[n] - pb[n]).abs().max()) for n in pa)
    return {"bit_identical": all(torch.equal(pa[n], pb[n]) for n in pa), "max_abs_diff": diff}


def steps_per_run(sync_every: int, steps: int) -> int:
    """The warm-up round, then whole rounds of at least ``steps`` steps (and at least 2 rounds)."""
    return sync_every * (1 + max(2, math.ceil(steps / sync_every)))


def collect(args: argparse.Namespace, shape: dict[str, int], sides: list[str], root: Path) -> tuple[dict, dict]:
    """Every run, repeats interleaving the sides; and how far adloco's and torchft's final parameters are apart."""
    runs: dict[int, dict[str, list[dict]]] = {h: {s: [] for s in sides} for h in args.sync_every}
    agreements: dict[int, dict] = {}
    plan = [(side, h, steps_per_run(h, args.steps)) for h in args.sync_every for side in sides]
    for repeat in range(args.repeats):
        for run in run_repeat(plan, shape, root / f"repeat{repeat}", args.timeout):
            h = run["sync_every"]
            runs[h][run["side"]].append(run)
            step = _median_step(run, h) * 1000
            print(f"repeat {repeat}, H = {h}, {run['side']}: {step:.1f} ms a step", flush=True)
        for h in args.sync_every:
            if repeat == 0 and "torchft" in sides:
                agreements[h] = agreement(runs[h]["adloco"][0]["params"], runs[h]["torchft"][0]["params"])
    return runs, agreements


def measure(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    missing = torchft_missing()
    sides = [s for s in SIDES if s != "torchft" or missing is None]
    with tempfile.TemporaryDirectory(prefix="own_loop_cost_") as tmp:
        runs, agreements = collect(args, shape, sides, Path(tmp))
    results = {}
    for h, by_side in runs.items():
        rows = {side: summary(side_runs, h) for side, side_runs in by_side.items()}
        bare = rows["bare"]
        bare["sync_extra_ms"] = 0.0  # nothing syncs: its sync steps are steps like the others
        for row in rows.values():
            row["hooks_ms"] = row["optimizer_ms"] - bare["optimizer_ms"]
            row["hooks_share"] = row["hooks_ms"] / bare["step_ms"]
            # what the wrapper itself adds to a round: H steps' hooks and one sync, against H bare steps
            row["round_cost_share"] = (h * row["hooks_ms"] + row["sync_extra_ms"]) / (h * bare["step_ms"])
            row["round_over_bare"] = row["round_ms"] / bare["round_ms"]
        if missing is not None:
            rows["torchft"] = {"unavailable": missing}
        results[str(h)] = {"steps_per_run": steps_per_run(h, args.steps), "rows": rows,
                           "adloco_vs_torchft_parameters": agreements.get(h)}  # fmt: skip
    return {"results": results, "torchft_unavailable": missing}


def render(report: dict[str, Any]) -> str:
    """The section docs/own-loop.md shows: provenance, a table per H, and adloco's costs against torchft's."""
    v = report["versions"]
    lines = [
        f"Measured {report['date']} with `{report['command']}`: adloco {v['adloco']}, torchft {v['torchft']}, torch "
        f"{v['torch']}, Python {v['python']}; {report['machine']}. 2 torchrun ranks × 1 thread on loopback (gloo), "
        f"a {report['parameters'] / 1e6:.1f} M-parameter LLaMA-like model, {report['shape']['batch']} × "
        f"{report['shape']['context']} tokens a step per rank, {report['repeats']} interleaved repeat(s), 1-min load "
        f"average {report['load_average_1min']['before']} before and {report['load_average_1min']['after']} after; "
        "medians over both ranks' steps after the first round. *hooks a step*: the wrapper's `optimizer.step()` "
        "less the bare loop's (the same AdamW), against a bare step; *sync's extra*: what a sync adds to "
        "`optimizer.step()` on the rank that reached it last.",
    ]
    verdicts = []
    for h, result in report["results"].items():
        rows = result["rows"]
        lines += ["", f"H = {h} ({result['steps_per_run']} steps a run):", "",
                  "| loop | step (ms) | optimizer.step (ms) | hooks a step | sync's extra (ms) | hooks + sync a round "
                  "| round / bare |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for side in SIDES:
            row = rows.get(side)
            if row is None:
                continue
            if "unavailable" in row:
                missing = f"not run: torchft cannot be imported ({row['unavailable']})"
                lines.append(f"| {LABELS[side]} | {missing} | | | | | |")
                continue
            hooks = "—" if side == "bare" else f"{row['hooks_ms']:+.2f} ms ({row['hooks_share']:+.2%})"
            extra = "—" if side == "bare" else f"{row['sync_extra_ms']:.0f}"
            cost = "—" if side == "bare" else f"{row['round_cost_share']:+.2%}"
            lines.append(f"| {LABELS[side]} | {row['step_ms']:.1f} | {row['optimizer_ms']:.2f} | {hooks} | {extra} "
                         f"| {cost} | {row['round_over_bare']:.3f}× |")  # fmt: skip
        same = result.get("adloco_vs_torchft_parameters")
        if same is not None:
            end = "bit-identical" if same["bit_identical"] else f"max abs diff {same['max_abs_diff']:.2g}"
            lines += ["", f"Final parameters, adloco against torchft: {end}."]
        torchft, adloco = rows.get("torchft", {}), rows["adloco"]
        if "step_ms" in torchft:
            verdicts.append(
                f"H = {h}: hooks {adloco['hooks_ms'] - torchft['hooks_ms']:+.2f} ms a step, a sync "
                f"{adloco['sync_extra_ms'] - torchft['sync_extra_ms']:+.0f} ms, a round "
                f"{adloco['round_over_bare']:.3f}× the bare loop's against {torchft['round_over_bare']:.3f}×"
            )
    if verdicts:
        lines += ["", "adloco less torchft: " + "; ".join(verdicts) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync-every", type=int, nargs="+", default=[10, 50], help="H values")
    parser.add_argument("--steps", type=int, default=200, help="counted steps per run, at least (whole rounds)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every side")
    parser.add_argument("--quick", action="store_true", help="a tiny model, H = 2, a few steps, one repeat")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before one job is stopped")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--write", action="store_true", help="render the table into --doc between the markers")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)  # internal: one torchrun rank
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_loop:
        rank_main(args)
        return None
    if args.quick:
        args.sync_every, args.steps, args.repeats, args.timeout = [2], 4, 1, min(args.timeout, 120.0)
    if min(args.sync_every) < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--sync-every, --steps and --repeats must be positive")
    shape = QUICK if args.quick else FULL
    import adloco

    missing = torchft_missing()
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: the load says how much
    measured = measure(args, shape)
    command = "python benchmarks/own_loop_cost.py" + (" --quick" if args.quick else "")
    if not args.quick:
        command += f" --sync-every {' '.join(map(str, args.sync_every))} --steps {args.steps} --repeats {args.repeats}"
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "versions": {
            "adloco": adloco.__version__,
            "torchft": "not installed" if missing else importlib.metadata.version("torchft"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": _machine(),
        "shape": shape,
        "parameters": parameters_of(shape),
        "quick": args.quick,
        "repeats": args.repeats,
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        **measured,
    }
    text = render(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    if args.write:
        from link import write_between

        write_between(args.doc, *MARKERS, text)
        print(f"written: {args.doc}")
    return report


def _machine() -> str:
    from link import machine

    return machine()


if __name__ == "__main__":
    main()
