"""A whole run: run directory, rounds until the token budget is spent, evaluation, checkpoints, export."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from adloco.algorithms.schedules import inner_lr
from adloco.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
from adloco.cluster import Cluster, StepReport
from adloco.comm import Communicator, LocalCommunicator
from adloco.comm.distributed import DistributedCommunicator, launched_by_torchrun
from adloco.config import ConfigError, TrainConfig, load_config
from adloco.data import Corpus, dataset_label, get_tokenizer, validation_blocks
from adloco.metrics import MetricsWriter, make_progress
from adloco.model import build_model, next_token_loss, preset_config

log = logging.getLogger("adloco")

CONFIG_FILE = "config.yaml"


class NonFiniteError(RuntimeError):
    """Training keeps producing NaN/inf: stop, keeping the last good checkpoint."""


@dataclass
class TrainResult:
    run_dir: Path
    val_loss: float
    perplexity: float
    tokens: int
    rounds: int
    seconds: float
    bytes_sent: int
    best_trainer: int


def make_run_dir(config: TrainConfig) -> Path:
    root = Path(config.run.root)
    if config.run.name:
        name = config.run.name
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        name = f"{config.model.preset}_{dataset_label(config.data.dataset)}_{stamp}"
    path = root / name
    suffix = 1
    while path.exists():
        suffix += 1
        path = root / f"{name}-{suffix}"
    try:
        path.mkdir(parents=True)
        (path / "checkpoints").mkdir()
    except OSError as error:
        raise ConfigError(f"run directory '{path}' cannot be created: {error.strerror}") from None
    return path


@torch.no_grad()
def evaluate(model: torch.nn.Module, theta: list[torch.Tensor], blocks: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token loss of θ over ``blocks`` (each of context + 1 tokens)."""
    for p, t in zip(model.parameters(), theta, strict=True):
        p.copy_(t)
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch):
        chunk = blocks[start : start + batch]
        loss = next_token_loss(model, chunk[:, :-1], chunk[:, 1:])
        total += float(loss) * chunk.numel()
        count += chunk.numel()
    model.train()
    return total / count


def _attach_log_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("adloco")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def _export_final(model: torch.nn.Module, theta: list[torch.Tensor], run_dir: Path, tokenizer_info: dict) -> Path:
    with torch.no_grad():
        for p, t in zip(model.parameters(), theta, strict=True):
            p.copy_(t)
    final = run_dir / "final"
    staging = run_dir / ".final.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "adloco_tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def make_communicator(config: TrainConfig) -> Communicator:
    """torch.distributed when launched by torchrun, else a world of one rank in this process."""
    if launched_by_torchrun():
        return DistributedCommunicator(config.comm.backend, config.comm.timeout_s, config.comm.reduce)
    return LocalCommunicator()


def resolve_device(config: TrainConfig) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _prepare_run_dir(config: TrainConfig, resume: Path | None) -> Path:
    if resume is not None:
        if not (resume / "checkpoints").is_dir() or not list_checkpoints(resume / "checkpoints"):
            raise CheckpointError(f"run directory '{resume}' has no checkpoint to resume from")
        return resume
    run_dir = make_run_dir(config)
    (run_dir / CONFIG_FILE).write_text(config.to_yaml())
    return run_dir


def train(
    config: TrainConfig,
    resume: Path | None = None,
    console: Console | None = None,
    comm: Communicator | None = None,
) -> TrainResult:
    """Run training to the token budget (or continue a run from its last checkpoint).

    Under torchrun every rank calls this; rank 0 alone writes the run directory.
    """
    console = console or Console(stderr=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    owns_comm = comm is None
    comm = comm or make_communicator(config)
    try:
        return _train_with(config, resume, console, comm)
    finally:
        if owns_comm:
            comm.close()


def _train_with(config: TrainConfig, resume: Path | None, console: Console, comm: Communicator) -> TrainResult:
    device = resolve_device(config)
    tokenizer = get_tokenizer(config.data.tokenizer)
    model_config = preset_config(config.model.preset, tokenizer.vocab_size, config.model.context)
    context = int(model_config.max_position_embeddings)
    corpus = Corpus.load(config.data.dataset, tokenizer, config.data.val_fraction, context)

    # Rank 0 decides the run directory; an error there is every rank's error.
    outcome: tuple[str, str] = ("ok", "")
    if comm.rank == 0:
        try:
            outcome = ("ok", str(_prepare_run_dir(config, resume)))
        except (ConfigError, CheckpointError) as error:
            outcome = (type(error).__name__, str(error))
    outcome = comm.broadcast_object(outcome, src=0)
    if outcome[0] != "ok":
        raise (CheckpointError if outcome[0] == "CheckpointError" else ConfigError)(outcome[1])
    run_dir = Path(outcome[1])
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if resume is not None else None
    handler = _attach_log_file(run_dir) if comm.rank == 0 else None
    try:
        return _train_in(config, run_dir, corpus, model_config, tokenizer.describe(), checkpoint, console, comm, device)
    finally:
        if handler is not None:
            logging.getLogger("adloco").removeHandler(handler)
            handler.close()


def _train_in(config, run_dir, corpus, model_config, tokenizer_info, checkpoint, console, comm, device) -> TrainResult:
    is_root = comm.rank == 0
    cluster = Cluster(config, model_config, corpus, comm, device)
    context = cluster.context
    eval_model = build_model(model_config, config.seed).to(device) if is_root else None
    val_subset = validation_blocks(corpus.val, context, config.eval.blocks).to(device)

    counters = {"round": 0, "tokens": 0, "step": 0, "bytes": 0, "seconds": 0.0}
    if checkpoint is not None:
        cluster.load_state_dict(checkpoint["cluster"])
        counters.update(checkpoint["counters"])
        log.info("resumed from round %d (%d tokens)", counters["round"], counters["tokens"])
    else:
        log.info(
            "start: method=%s trainers=%d workers=%d H=%d params=%d context=%d tokens=%d ranks=%d",
            config.method,
            config.trainers,
            config.workers,
            config.sync_every,
            sum(t.numel() for t in next(iter(cluster.trainers.values())).theta),
            context,
            config.total_tokens,
            comm.world_size,
        )
    metrics = (
        MetricsWriter(run_dir / "metrics.jsonl", resume_round=counters["round"] - 1 if checkpoint else None)
        if is_root
        else None
    )
    total = config.total_tokens
    started = time.perf_counter() - counters["seconds"]
    last_val: dict[int, float] = {}  # updated in place: the step callback reads it
    failed_streak = 0
    progress = make_progress(console, config.run.progress and is_root)
    with progress:
        task = progress.add_task(config.method, total=total, completed=counters["tokens"], status="")
        while counters["tokens"] < total:
            round_index = counters["round"]
            round_start = time.perf_counter()
            per_step = cluster.tokens_per_step()
            plans = cluster.plans()
            for k, plan in plans.items():
                if plan.mode != "single":
                    log.info(
                        "round %d trainer %d: b_req %d, b_max %d -> %s plan %s",
                        round_index,
                        k,
                        cluster.trainers[k].batch_size,
                        cluster.worker_b_max[cluster.trainers[k].worker_ids[0]],
                        plan.mode,
                        plan.sizes,
                    )
            batch_label = ",".join(str(t.batch_size) for t in cluster.trainers.values())
            steps = min(config.sync_every, math.ceil((total - counters["tokens"]) / per_step))
            first_step, tokens_before = counters["step"], counters["tokens"]

            def lr_at(step: int, first_step=first_step, tokens_before=tokens_before, per_step=per_step) -> float:
                fraction = (tokens_before + step * per_step) / total
                inner = config.inner
                return inner_lr(first_step + step, fraction, inner.lr, inner.min_lr, inner.warmup_steps)

            def on_step(report: StepReport, round_index=round_index, batch_label=batch_label) -> None:
                counters["step"] += 1
                counters["tokens"] += report.tokens
                if metrics is None:
                    return
                metrics.write(
                    "step",
                    round=round_index,
                    step=counters["step"],
                    loss=report.loss,
                    lr=report.lr,
                    tokens=counters["tokens"],
                )
                mean_loss = sum(report.loss.values()) / len(report.loss)
                val = f" val {min(last_val.values()):.3f}" if last_val else ""
                progress.update(
                    task,
                    completed=min(counters["tokens"], total),
                    status=f"round {round_index + 1} · {len(report.loss)} trainer(s) b={batch_label} · "
                    f"loss {mean_loss:.3f}{val}",
                )

            report = cluster.run_round(round_index, steps, lr_at, on_step, first_step=first_step)
            failed_streak = failed_streak + 1 if report.skipped else 0
            merge = cluster.maybe_merge(round_index)
            comm_stats = comm.stats.take()
            per_rank = comm.gather_objects((comm_stats.bytes_sent, comm_stats.wire_bytes, comm_stats.seconds))
            # Each rank counts the payloads of the workers it hosts; rank 0 adds them up for the job.
            round_bytes = sum(p[0] for p in per_rank) if per_rank else comm_stats.bytes_sent
            counters["bytes"] += round_bytes
            counters["round"] = round_index + 1
            finished = counters["tokens"] >= total
            if finished:
                cluster.flush()  # streaming: exchanges still in flight count towards the final θ
            evaluated = (round_index + 1) % config.eval.every == 0 or finished
            if evaluated and is_root:
                last_val.clear()
                last_val.update({k: evaluate(eval_model, t.theta, val_subset) for k, t in cluster.trainers.items()})
            counters["seconds"] = time.perf_counter() - started
            if metrics is not None:
                metrics.write(
                    "round",
                    round=round_index,
                    steps=steps,
                    tokens=counters["tokens"],
                    train_loss=report.loss,
                    val_loss=dict(last_val) if evaluated else None,
                    bytes=round_bytes,
                    bytes_total=counters["bytes"],
                    comm_seconds=comm_stats.seconds,
                    ranks=[
                        {"rank": r, "payload_bytes": p, "wire_bytes": w, "comm_seconds": t}
                        for r, (p, w, t) in enumerate(per_rank)
                    ],
                    round_seconds=time.perf_counter() - round_start,
                    seconds=counters["seconds"],
                    batch={k: t.batch_size for k, t in cluster.trainers.items()},
                    batch_test=report.batch or None,
                    plan={
                        k: {"micro": p.micro, "accum": p.accum, "samples": p.samples, "mode": p.mode}
                        for k, p in plans.items()
                    },
                    workers={k: len(t.worker_ids) for k, t in cluster.trainers.items()},
                    merge=merge.to_dict() if merge else None,
                    peak_sync_bytes=cluster.peak_sync_bytes,
                    failed_workers=report.failed,
                    skipped_trainers=report.skipped,
                )
                if merge is not None:
                    metrics.write("merge", **merge.to_dict())
                metrics.flush()
            if failed_streak >= config.run.max_failed_rounds:
                raise NonFiniteError(
                    f"non-finite losses or gradients on every worker of a trainer for {failed_streak} rounds in a "
                    f"row (round {round_index}); the last good checkpoint is in {run_dir / 'checkpoints'}"
                )
            if not report.skipped and ((round_index + 1) % config.checkpoint.every == 0 or finished):
                state = cluster.state_dict()  # collective: every rank hands its workers' state to rank 0
                if is_root:
                    save_checkpoint(
                        run_dir / "checkpoints",
                        round_index,
                        {"cluster": state, "counters": dict(counters), "config": config.model_dump()},
                        keep=config.checkpoint.keep,
                    )

    if not is_root:
        summary = comm.broadcast_object(None, src=0)
        return TrainResult(run_dir=run_dir, **summary)
    full = validation_blocks(corpus.val, context).to(device) if config.eval.final_full else val_subset
    final_val = {k: evaluate(eval_model, t.theta, full) for k, t in cluster.trainers.items()}
    best = min(final_val, key=final_val.get)
    seconds = time.perf_counter() - started
    result = TrainResult(
        run_dir=run_dir,
        val_loss=final_val[best],
        perplexity=math.exp(final_val[best]),
        tokens=counters["tokens"],
        rounds=counters["round"],
        seconds=seconds,
        bytes_sent=counters["bytes"],
        best_trainer=best,
    )
    metrics.write(
        "final",
        round=counters["round"] - 1,
        val_loss=final_val,
        best_trainer=best,
        perplexity=result.perplexity,
        tokens=result.tokens,
        rounds=result.rounds,
        bytes_total=result.bytes_sent,
        seconds=seconds,
        validation_tokens=int(full[:, 1:].numel()),
    )
    metrics.close()
    if config.run.save_final:
        _export_final(eval_model, cluster.trainers[best].theta, run_dir, tokenizer_info)
    if config.run.plots:
        from adloco.plots import plot_run

        try:
            plot_run(run_dir)
        except Exception as error:  # a plot must never cost a finished run
            log.warning("could not write plots: %s", error)
    comm.broadcast_object({k: v for k, v in result.__dict__.items() if k != "run_dir"}, src=0)
    log.info(
        "done: val loss %.4f (perplexity %.2f), %d tokens, %.1f s",
        result.val_loss,
        result.perplexity,
        result.tokens,
        seconds,
    )
    return result


def resume_config(run_dir: Path) -> TrainConfig:
    """The resolved config a run directory was started with."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise ConfigError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise ConfigError(f"'{run_dir}' is not a run directory (no {CONFIG_FILE})")
    return load_config(path)
