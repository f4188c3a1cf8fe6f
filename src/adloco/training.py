"""A whole run: run directory, rounds until the token budget is spent, evaluation, checkpoints, export."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console

from adloco.algorithms.schedules import inner_lr
from adloco.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from adloco.cluster import Cluster, StepReport
from adloco.comm import LocalCommunicator
from adloco.config import ConfigError, TrainConfig, load_config
from adloco.data import Corpus, dataset_label, get_tokenizer, validation_blocks
from adloco.metrics import MetricsWriter, make_progress
from adloco.model import build_model, next_token_loss, parameter_count, preset_config

log = logging.getLogger("adloco")

CONFIG_FILE = "config.yaml"


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
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "adloco_tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def train(config: TrainConfig, resume: Path | None = None, console: Console | None = None) -> TrainResult:
    """Run training to the token budget (or continue a run from its last checkpoint)."""
    console = console or Console(stderr=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = get_tokenizer(config.data.tokenizer)
    model_config = preset_config(config.model.preset, tokenizer.vocab_size, config.model.context)
    context = int(model_config.max_position_embeddings)
    corpus = Corpus.load(config.data.dataset, tokenizer, config.data.val_fraction, context)

    checkpoint = None
    if resume is not None:
        checkpoint = latest_checkpoint(resume / "checkpoints")
        if checkpoint is None:
            raise CheckpointError(f"run directory '{resume}' has no checkpoint to resume from")
        run_dir = resume
    else:
        run_dir = make_run_dir(config)
        (run_dir / CONFIG_FILE).write_text(config.to_yaml())
    handler = _attach_log_file(run_dir)
    try:
        return _train_in(config, run_dir, corpus, model_config, tokenizer.describe(), checkpoint, console)
    finally:
        logging.getLogger("adloco").removeHandler(handler)
        handler.close()


def _train_in(config, run_dir, corpus, model_config, tokenizer_info, checkpoint, console) -> TrainResult:
    comm = LocalCommunicator()
    cluster = Cluster(config, model_config, corpus, comm)
    context = cluster.context
    eval_model = build_model(model_config, config.seed)
    val_subset = validation_blocks(corpus.val, context, config.eval.blocks)

    counters = {"round": 0, "tokens": 0, "step": 0, "bytes": 0, "seconds": 0.0}
    if checkpoint is not None:
        cluster.load_state_dict(checkpoint["cluster"])
        counters.update(checkpoint["counters"])
        log.info("resumed from round %d (%d tokens)", counters["round"], counters["tokens"])
    else:
        log.info(
            "start: method=%s trainers=%d workers=%d H=%d params=%d context=%d tokens=%d",
            config.method,
            config.trainers,
            config.workers,
            config.sync_every,
            parameter_count(eval_model),
            context,
            config.total_tokens,
        )
    metrics = MetricsWriter(run_dir / "metrics.jsonl", resume_round=counters["round"] - 1 if checkpoint else None)
    total = config.total_tokens
    started = time.perf_counter() - counters["seconds"]
    last_val: dict[int, float] = {}  # updated in place: the step callback reads it
    progress = make_progress(console, config.run.progress)
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
                        cluster.b_max,
                        plan.mode,
                        plan.sizes,
                    )
            batch_label = ",".join(str(t.batch_size) for t in cluster.trainers.values())
            steps = min(config.sync_every, math.ceil((total - counters["tokens"]) / per_step))
            first_step, tokens_before = counters["step"], counters["tokens"]

            def lr_at(step: int, first_step=first_step, tokens_before=tokens_before, per_step=per_step) -> float:
                progress_fraction = (tokens_before + step * per_step) / total
                return inner_lr(
                    first_step + step,
                    progress_fraction,
                    config.inner.lr,
                    config.inner.min_lr,
                    config.inner.warmup_steps,
                )

            def on_step(report: StepReport, round_index=round_index, batch_label=batch_label) -> None:
                counters["step"] += 1
                counters["tokens"] += report.tokens
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

            report = cluster.run_round(round_index, steps, lr_at, on_step)
            merge = cluster.maybe_merge(round_index)
            comm_stats = comm.stats.take()
            counters["bytes"] += comm_stats.bytes_sent
            counters["round"] = round_index + 1
            finished = counters["tokens"] >= total
            if (round_index + 1) % config.eval.every == 0 or finished:
                last_val.clear()
                last_val.update({k: evaluate(eval_model, t.theta, val_subset) for k, t in cluster.trainers.items()})
            counters["seconds"] = time.perf_counter() - started
            metrics.write(
                "round",
                round=round_index,
                steps=steps,
                tokens=counters["tokens"],
                train_loss=report.loss,
                val_loss=last_val if ((round_index + 1) % config.eval.every == 0 or finished) else None,
                bytes=comm_stats.bytes_sent,
                bytes_total=counters["bytes"],
                comm_seconds=comm_stats.seconds,
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
            )
            if merge is not None:
                metrics.write("merge", **merge.to_dict())
            metrics.flush()
            if (round_index + 1) % config.checkpoint.every == 0 or finished:
                save_checkpoint(
                    run_dir / "checkpoints",
                    round_index,
                    {
                        "cluster": cluster.state_dict(),
                        "counters": dict(counters),
                        "config": config.model_dump(),
                    },
                    keep=config.checkpoint.keep,
                )

    full = validation_blocks(corpus.val, context) if config.eval.final_full else val_subset
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
