"""A run's metrics records: each round's record and its step records, and the traffic and memory figures of
every rank, gathered without blocking any rank and written when they are in."""

from __future__ import annotations

import math
import time

import torch

from adloco.algorithms.flops import utilisation
from adloco.cluster.cluster import MergeEvent, RoundReport
from adloco.metrics.writer import memory_snapshot
from adloco.run.state import RoundPlan, RunState

_TRAFFIC = ("bytes_sent", "wire_bytes", "seconds", "exchanges", "wait_seconds")
_MEMORY = ("rss_mib", "peak_rss_mib", "cuda_allocated_mib", "cuda_peak_allocated_mib", "cuda_reserved_mib")


def gather_round_figures(run: RunState) -> torch.futures.Future:
    """Start gathering every rank's traffic, exchanges, waiting and memory in the round."""
    taken = run.comm.stats.take()
    memory = memory_snapshot(run.device)
    values = [float(getattr(taken, key)) for key in _TRAFFIC]
    values += [math.nan if memory.get(key) is None else float(memory[key]) for key in _MEMORY]  # type: ignore[arg-type]
    return run.comm.gather_floats(values)


def settle(run: RunState) -> None:
    """Wait for the pending round's figures (long arrived, normally), count its bytes, write its records."""
    pending, run.pending = run.pending, None
    if pending is None:
        return
    per_rank = pending.traffic.wait()
    run.counters["bytes"] += int(sum(values[0] for values in per_rank))
    if run.metrics is None:
        return
    for record in pending.step_records:
        run.metrics.write("step", **record)
    pending.record.update(traffic_fields(per_rank, run.counters["bytes"]))
    run.metrics.write("round", **pending.record)
    if pending.merge is not None:
        run.metrics.write("merge", **pending.merge.to_dict())
    run.metrics.flush()


def traffic_fields(per_rank: list[list[float]], bytes_total: int) -> dict:
    ranks, memory = [], []
    for rank, values in enumerate(per_rank):
        traffic = dict(zip(_TRAFFIC, values, strict=False))
        ranks.append(
            {
                "rank": rank,
                "payload_bytes": int(traffic["bytes_sent"]),
                "wire_bytes": int(traffic["wire_bytes"]),
                "comm_seconds": traffic["seconds"],
                "exchanges": int(traffic["exchanges"]),
                "wait_seconds": traffic["wait_seconds"],
            }
        )
        held = dict(zip(_MEMORY, values[len(_TRAFFIC) :], strict=True))
        memory.append({"rank": rank, **{k: v for k, v in held.items() if not math.isnan(v)}})
    return {
        "bytes": sum(r["payload_bytes"] for r in ranks),
        "bytes_total": bytes_total,
        "comm_seconds": ranks[0]["comm_seconds"],
        "exchanges": ranks[0]["exchanges"],
        "wait_seconds": ranks[0]["wait_seconds"],
        "ranks": ranks,
        "memory": memory,
    }


def advance(run: RunState, plan: RoundPlan, report: RoundReport) -> list[dict]:
    """Move the counters past the round; returns its step records (the losses came with the round's exchange)."""
    counters = run.counters
    records = []
    for step, (losses, tokens) in enumerate(zip(report.step_loss, report.step_tokens, strict=True)):
        counters["step"] += 1
        counters["tokens"] += tokens
        records.append(
            {
                "round": plan.index + 1,
                "step": counters["step"],
                "loss": losses,
                "lr": plan.lr_at(run.config.inner, run.config.total_tokens, step),
                "tokens": counters["tokens"],
            }
        )
    counters["round"] = plan.index + 1  # the bytes follow when the round's traffic figures arrive (settle)
    return records


def round_record(
    run: RunState, plan: RoundPlan, report: RoundReport, merge: MergeEvent | None, evaluated: bool, eval_seconds: float
) -> dict:
    """The round's record as of its end; the traffic fields (None here) are filled in by ``settle``."""
    counters, cluster = run.counters, run.cluster
    seconds = time.perf_counter() - plan.started
    classification = run.config.task == "classification"
    trained = counters["tokens"] - plan.tokens_before
    mfu = None  # the round's training, its evaluation left out
    if run.peak_flops is not None:
        mfu = utilisation(trained / max(seconds - eval_seconds, 1e-9), run.flops_per_token, run.peak_flops)
    return dict(
        round=plan.index + 1,
        steps=plan.steps,
        sync_every=plan.sync_every,
        sync=report.sync or None,
        tokens=counters["tokens"],
        train_loss=report.loss,
        val_loss=dict(run.last_val) if evaluated else None,
        **({"val_accuracy": dict(run.last_accuracy) if evaluated else None} if classification else {}),
        **dict.fromkeys(("bytes", "bytes_total", "comm_seconds", "exchanges", "wait_seconds", "ranks", "memory")),
        step=counters["step"],
        tokens_per_second=trained / max(seconds, 1e-9),
        mfu=mfu,
        round_seconds=seconds,
        eval_seconds=eval_seconds,
        seconds=counters["seconds"],
        batch={k: t.batch_size for k, t in cluster.trainers.items()},
        lr_scale={k: t.batch.lr_scale for k, t in cluster.trainers.items()},
        beta2={k: t.batch.beta2(run.config.inner.beta2) for k, t in cluster.trainers.items()},
        batch_test=report.batch or None,
        plan={
            k: {"micro": p.micro, "accum": p.accum, "samples": p.samples, "mode": p.mode} for k, p in plan.plans.items()
        },
        workers={k: len(t.worker_ids) for k, t in cluster.trainers.items()},
        **({"samples": plan.samples} if run.config.batch.shares == "speed" else {}),
        merge=merge.to_dict() if merge else None,
        peak_sync_bytes=cluster.peak_sync_bytes,
        failed_workers=report.failed,
        skipped_trainers=report.skipped,
    )
