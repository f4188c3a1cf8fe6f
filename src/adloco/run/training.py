"""A whole run: rounds until the token budget is spent, evaluation, checkpoints, export (its directory: ``run_dir``)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from adloco.algorithms.sharding import ShardLayout
from adloco.checkpoint import (
    TRAIN,
    CheckpointError,
    apply_umask,
    checkpoint_round,
    latest_checkpoint,
    save_checkpoint,
    write_failure,
)
from adloco.cluster.cluster import Cluster, RoundReport, StepProgress
from adloco.cluster.placement import check_world, elastic_size, hosted_workers, resolve_device
from adloco.comm.base import Communicator
from adloco.comm.distributed import (
    DistributedCommunicator,
    launched_by_torchrun,
    max_restarts,
    restart_attempt,
    world_size_from_env,
)
from adloco.comm.local import LocalCommunicator
from adloco.config import CommConfig, RunConfig, TrainConfig, resume_changes
from adloco.data import (
    SAVED_DIR,
    build_tokenizer,
    load_corpus,
    names_token_files,
    save_byte_tokenizer,
    save_tokenizer,
    source_from_config,
    training_texts,
)
from adloco.errors import StorageError
from adloco.metrics.tracking import open_trackers
from adloco.metrics.writer import MetricsWriter, RunDisplay, job_peak_flops
from adloco.models.build import flops_per_token_of
from adloco.models.compilation import check_compile
from adloco.run.directory import (
    RunIdentity,
    agree_on_restart,
    attach_log_file,
    claim_run_dir,
    newest_checkpoint,
    run_label,
    write_run_config,
)
from adloco.run.preflight import check_rank_memory
from adloco.run.records import advance, gather_round_figures, round_record, settle
from adloco.run.runs import RunLock
from adloco.run.state import PendingRound, RoundPlan, RunState
from adloco.run.stopping import Interrupted, Stopped, StopSignals
from adloco.sync.trainer import theta_device
from adloco.workers.reports import BoundaryRequest
from adloco.workers.tasks import Task, TaskSettings, build_task, classification_texts, mean_next_token_loss

log = logging.getLogger("adloco")


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
    accuracy: float | None = None  # task=classification: validation accuracy of the best trainer


@torch.no_grad()
def evaluate(model: torch.nn.Module, theta: list[torch.Tensor], blocks: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token loss of θ over ``blocks`` (each of context + 1 tokens)."""
    return mean_next_token_loss(model, theta, blocks, batch)


def export_final(model: torch.nn.Module, theta: list[torch.Tensor], run_dir: Path, tokenizer_info: dict) -> Path:
    """θ into ``model`` and saved with the run's tokenizer as ``run_dir/final`` (staged, so written whole or not)."""
    with torch.no_grad():
        for p, t in zip(model.parameters(), theta, strict=True):
            p.copy_(t)
    final = run_dir / "final"
    staging = run_dir / ".final.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    from adloco.models.build import no_progress_bar

    no_progress_bar()
    try:
        model.save_pretrained(staging, safe_serialization=True)
        (staging / "adloco_tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2) + "\n")
        if (run_dir / SAVED_DIR).is_dir():  # bpe/HF tokenizers: final/ loads with AutoTokenizer too
            shutil.copytree(run_dir / SAVED_DIR, staging, dirs_exist_ok=True)
        elif tokenizer_info.get("type", "byte") == "byte":
            save_byte_tokenizer(staging)
        apply_umask(staging)  # some writers (safetensors) make owner-only files; the user's umask decides
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise write_failure(error, "the final model", final) from None
    return final


def make_communicator(comm: CommConfig) -> Communicator:
    """torch.distributed when launched by torchrun (the ``comm`` section's backend), else a world of one rank in
    this process."""
    if launched_by_torchrun():
        return DistributedCommunicator(comm.backend, comm.timeout_s, comm.reduce)
    return LocalCommunicator()


def run_identity(config: TrainConfig) -> RunIdentity:
    """What the run directory keeps of this run (its config.yaml, the stem of its default name)."""
    elastic_workers = config.workers if config.elastic else None  # a restart may resize an elastic job
    return RunIdentity(config.run, run_label(config.model, config.data), config.to_yaml(), elastic_workers)


def train(
    config: TrainConfig,
    resume: Path | None = None,
    console: Console | None = None,
    comm: Communicator | None = None,
) -> TrainResult:
    """Run training to the token budget (or continue a run from its last checkpoint).

    Under torchrun every rank calls this; rank 0 alone writes the run directory. Given no ``comm``, it makes the
    process group and ends it with the run, unless the program made the group first: then the group (its backend
    and timeout) is the program's, which may train several runs in it and ends it (``adloco.end_process_group``).
    """
    console = console or Console(stderr=True)
    torchrun = comm is not None and comm.world_size > 1 or launched_by_torchrun()
    check_world(config.world, comm.world_size if comm is not None else world_size_from_env(), torchrun)
    if config.threads:
        torch.set_num_threads(config.threads)
    owns_comm = comm is None
    comm = comm or make_communicator(config.comm)
    try:
        result = _train_with(config, resume, console, comm)
        if owns_comm:
            comm.barrier()  # ranks leave together: none tears its process groups down while a peer still uses them
        return result
    finally:
        if owns_comm:
            comm.close()


def _train_with(config: TrainConfig, resume: Path | None, console: Console, comm: Communicator) -> TrainResult:
    workers, resized = elastic_size(config.workers, comm.world_size, fresh=resume is None and restart_attempt() == 0,
                                    elastic=config.elastic, slots_per_rank=config.slots_per_rank,
                                    given="workers" in config.given_keys)  # fmt: skip
    if workers != config.workers:  # a copy: the caller's config keeps the workers it named
        config = config.model_copy(update={"workers": workers})
    device, config.precision = resolve_device(config.device, config.precision, config.tf32)  # config.yaml records it
    # run.mfu=true on a device of unknown peak: refused now
    job_peak_flops(config.run, config.precision, config.tf32, device, comm.world_size)
    theta_device(config.outer.device, device, 0, user_loop=False)  # outer.device=cuda without one: refused now
    if config.compile:
        check_compile(device)
    identity = run_identity(config)
    # A torchrun attempt after a failure continues the run its first attempt made, with no --resume needed.
    restart = agree_on_restart(identity, comm) if restart_attempt() > 0 else None
    again = None
    if restart is not None and restart[0] == "resume":
        resume = Path(restart[1])
    elif restart is not None and restart[0] == "again":
        again = Path(restart[1])
    tokenizer, run_task = tokenizer_and_task(config, resume)
    if device.type == "cpu":  # a GPU's own limit is b_max's business (resolve_b_max probes it)
        hosted = hosted_workers(comm.rank, comm.world_size, total_workers=config.total_workers,
                                slots_per_rank=config.slots_per_rank, shards=config.shards)  # fmt: skip
        workers_here = len(hosted)  # a shard of each when sharded
        check_rank_memory(run_task.build_skeleton(), run_task.context, workers_here, trainers=config.trainers,
                          batch_size=config.batch.size, shards=config.shards)  # fmt: skip
    lock, run_dir = claim_run_dir(identity, resume, again, comm)
    if comm.rank == 0 and resume is None:
        save_tokenizer(tokenizer, run_dir / SAVED_DIR)
    handler = attach_log_file(run_dir) if comm.rank == 0 else None  # before the checkpoint's warnings
    if lock is not None:
        log.info("run directory %s", run_dir)
        if config.run.progress:  # where the run lives, before it starts rather than after it ends
            console.print(f"adloco: run directory {run_dir}", markup=False, highlight=False, soft_wrap=True)
        if lock.took_over:
            _say(console, lock.took_over)
        if resized:
            _say(console, resized)
    error: BaseException | None = None
    started = False
    try:
        checkpoint = _resume_from(config, run_dir, lock, console, comm, run_task) if resume is not None else None
        if restart is not None and comm.rank == 0:
            _announce_restart(restart[0], run_dir, checkpoint, console)
        started = True
        return _train_in(_restore(config, run_dir, run_task, checkpoint, comm, device), tokenizer.describe(), console)
    except KeyboardInterrupt as raised:
        error = raised
        if isinstance(raised, Interrupted):
            raise
        raise Interrupted(run_dir, newest_checkpoint(run_dir)) from None
    except StorageError as raised:
        error = raised if started else None
        if not raised.disk_full:
            raise
        # whether --resume can continue depends on what reached the disk before it filled up
        newest = newest_checkpoint(run_dir)
        then = f"continue with --resume {run_dir}" if newest is not None else "start the run again (no checkpoint yet)"
        raise StorageError(f"{raised}; free some space and {then}") from None
    except BaseException as raised:
        error = raised if started else None  # a refused resume leaves the run as it was
        raise
    finally:
        if lock is not None:
            lock.release(error)
        if handler is not None:
            logging.getLogger("adloco").removeHandler(handler)
            handler.close()


def tokenizer_and_task(config: TaskSettings, resume: Path | None) -> tuple:
    """The run's tokenizer and task; a resumed run reloads the tokenizer it saved (a BPE is never trained twice)."""
    saved = resume / SAVED_DIR if resume is not None and config.data.tokenizer != "byte" else None
    if config.task == "classification":
        tokenizer = build_tokenizer(config.data, classification_texts(config.data), saved)
        return tokenizer, build_task(config.task, config.model, config.data, config.seed, tokenizer)
    # token files were tokenized already: their tokenizer is the one that wrote them, nothing is read to train one
    source = None if names_token_files(config.data.dataset) else source_from_config(config.data)
    texts = None if source is None else training_texts(config.data, source)
    tokenizer = build_tokenizer(config.data, texts, saved)
    return tokenizer, build_task(
        config.task,
        config.model,
        config.data,
        config.seed,
        tokenizer,
        lambda context: load_corpus(config.data, tokenizer, context, source, seed=config.seed),
    )


def _resume_from(
    config: TrainConfig, run_dir: Path, lock: RunLock | None, console: Console, comm: Communicator, task: Task
) -> dict:
    """The newest intact checkpoint, after checking that only resume-safe settings changed since it was written.
    Each rank keeps the workers it hosts (and those an elastic resize retires, whose streams every rank keeps), and
    its shard of them, cut anew if the checkpoint has another shard count."""
    hosted = hosted_workers(comm.rank, comm.world_size, total_workers=config.total_workers,
                            slots_per_rank=config.slots_per_rank, shards=config.shards)  # fmt: skip

    def wanted(worker_id: int) -> bool:
        return worker_id in hosted or worker_id >= config.total_workers

    layout = ShardLayout(
        comm.rank % config.shards, config.shards, lambda: {tuple(p.shape) for p in task.build_skeleton().parameters()}
    )

    def fell_back(problems: list[str], used: Path) -> None:
        if lock is not None:  # rank 0 speaks for the job; every rank checked every file and took the same one
            for problem in problems:
                _say(console, f"warning: {problem}")
            _say(
                console,
                f"resuming from the checkpoint of round {checkpoint_round(used)}, the newest intact one; the rounds "
                "after it are trained again",
            )

    checkpoint = latest_checkpoint(
        run_dir / "checkpoints", kind=TRAIN, wanted=wanted, layout=layout, on_fallback=fell_back
    )
    changes = resume_changes(checkpoint["config"], config)
    if lock is not None and changes:
        write_run_config(run_dir, config.to_yaml())  # the next resume starts from these settings
        _say(console, "resuming with changed settings: " + "; ".join(changes))
    return checkpoint


def _announce_restart(plan: str, run_dir: Path, checkpoint: dict | None, console: Console) -> None:
    where = f"restart {restart_attempt()} of {max_restarts()}"
    if plan == "resume" and checkpoint is not None:
        message = f"{where}: resuming {run_dir} from the checkpoint of round {checkpoint['counters']['round']}"
    elif plan == "again":
        message = f"{where}: the previous attempt left no checkpoint; starting {run_dir} over"
    else:
        message = f"{where}: the previous attempt left no run directory; starting {run_dir}"
    _say(console, message)


def _say(console: Console, message: str) -> None:
    """A line for the user on the terminal and in train.log."""
    log.info(message)
    console.print(f"adloco: {message}", markup=False, highlight=False, soft_wrap=True)


def _train_in(run: RunState, tokenizer_info: dict, console: Console) -> TrainResult:
    """Rounds until the budget is spent (or a stop signal), then the final evaluation and export."""
    config = run.config
    display = RunDisplay(
        console,
        config.method,
        total=config.total_tokens,
        done=run.counters["tokens"],
        enabled=config.run.progress and run.is_root,
        every_s=config.run.progress_every_s,
        log=log.info if run.is_root else lambda line: None,
    )
    _check_budget(run, console)
    with display, StopSignals(rank=run.comm.rank if run.comm.world_size > 1 else None) as stop:
        while run.counters["tokens"] < config.total_tokens:
            plan = _plan_round(run)
            report = run.cluster.run_round(
                plan.index,
                plan.steps,
                lambda step, plan=plan: plan.lr_at(config.inner, config.total_tokens, step),
                lambda step, plan=plan: _after_step(run, plan, step, display, stop),
                first_step=plan.first_step,
                ask=lambda: BoundaryRequest(stop_signal=stop.requested or 0, checkpoint=_checkpoint_time_due(run)),
                tokens_left=config.total_tokens - plan.tokens_before - plan.steps * plan.per_step,
            )
            _finish_round(run, plan, report)
            if report.request.stop_signal and run.counters["tokens"] < config.total_tokens:
                _stop(run, plan, report, report.request.stop_signal)
        display.show(run.counters["round"] - 1, run.counters["tokens"], "done", force=True)
    return _finish(run, tokenizer_info)


def _stop(run: RunState, plan: RoundPlan, report: RoundReport, signum: int) -> None:
    """A stop signal arrived: checkpoint this round unless that is done or impossible (a skipped round), then end."""
    settle(run)
    if run.last_checkpoint != plan.index + 1 and not report.skipped:
        _checkpoint(run, plan.index + 1)
    stopped = Stopped(signum, run.run_dir, run.last_checkpoint)
    log.info("%s", stopped)
    raise stopped


def _check_budget(run: RunState, console: Console) -> None:
    """A budget below one inner step still trains that step: say so rather than show a misleading 10/10."""
    per_step = run.cluster.tokens_per_step()
    done = run.counters["tokens"]
    if run.is_root and done >= run.config.total_tokens:
        _say(
            console,
            f"total_tokens={run.config.total_tokens:,} is spent already: the checkpoint holds {done:,} tokens; "
            "nothing is trained, the final evaluation and export follow (a larger total_tokens trains on)",
        )
    if run.is_root and done == 0 and run.config.total_tokens < per_step:
        _say(
            console,
            f"total_tokens={run.config.total_tokens} is less than one inner step ({per_step:,} tokens over all "
            f"workers); training that one step",
        )


def _restore(
    config: TrainConfig,
    run_dir: Path,
    run_task: Task,
    checkpoint: dict | None,
    comm: Communicator,
    device: torch.device,
) -> RunState:
    """The cluster, from the checkpoint when resuming; the metrics writer and trackers on rank 0."""
    cluster = Cluster(config, run_task, comm, device)
    counters = {"round": 0, "tokens": 0, "step": 0, "bytes": 0, "seconds": 0.0}
    if checkpoint is not None:
        try:
            cluster.load_state_dict(checkpoint["cluster"])
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            # Intact file, foreign content (e.g. a checkpoint of another config): one line, not a traceback.
            raise CheckpointError(
                f"checkpoint of round {checkpoint['round']} does not fit this run ({type(error).__name__}: "
                f"{str(error)[:120]})"
            ) from None
        counters.update(checkpoint["counters"])
        # The setup handshake (every worker's b_max) was counted in round 0 of the original run; repeating it to
        # resume is not training traffic, so bytes_total stays that of an uninterrupted run.
        comm.stats.take()
        log.info("resumed from round %d (%d tokens)", counters["round"], counters["tokens"])
    else:
        log.info(
            "start: method=%s trainers=%d workers=%d H=%s params=%d context=%d tokens=%d ranks=%d",
            config.method,
            config.trainers,
            config.workers,
            config.sync_every,
            sum(math.prod(shape) for shape in cluster.param_shapes),
            cluster.context,
            config.total_tokens,
            comm.world_size,
        )
    is_root = comm.rank == 0
    metrics = (
        _open_metrics(config.run, config.model_dump(mode="json"), run_dir, counters, checkpoint) if is_root else None
    )
    if metrics is not None and cluster.resized is not None:
        before, now = cluster.resized
        metrics.write(
            "resize", round=counters["round"] + 1, tokens=counters["tokens"], workers_before=before, workers=now
        )
    return RunState(
        config=config,
        run_dir=run_dir,
        task=run_task,
        comm=comm,
        device=device,
        cluster=cluster,
        counters=counters,
        metrics=metrics,
        eval_model=run_task.build_model(config.seed).to(device) if is_root else None,
        started=time.perf_counter() - counters["seconds"],
        last_checkpoint=checkpoint["round"] if checkpoint is not None else None,
        flops_per_token=flops_per_token_of(run_task.build_skeleton(), cluster.context),
        peak_flops=job_peak_flops(config.run, config.precision, config.tf32, device, comm.world_size),
    )


def _open_metrics(
    run: RunConfig, config: dict, run_dir: Path, counters: dict, checkpoint: dict | None
) -> MetricsWriter:
    """metrics.jsonl and the trackers; ``config`` is the whole run's, as the trackers record it."""
    return MetricsWriter(
        run_dir / "metrics.jsonl",
        # the checkpoint's own round: the run's records are numbered like it. A run written when rounds were counted
        # from 0 (its checkpoint's round is one less than the rounds done) has its records renumbered.
        resume_round=checkpoint["round"] if checkpoint is not None else None,
        renumber=int(checkpoint is not None and checkpoint["round"] == counters["round"] - 1),
        # Trackers hide their points after the checkpoint's inner step (all of them when starting over).
        trackers=open_trackers(
            run.trackers,
            run_dir,
            project=run.project,
            config=config,
            resume_step=counters["step"],
        ),
    )


def _plan_round(run: RunState) -> RoundPlan:
    """How many steps the next round takes (H, or fewer to end on the budget) and its micro-batch plans."""
    cluster, counters, config = run.cluster, run.counters, run.config
    per_step = cluster.tokens_per_step()
    plans = cluster.plans()
    for k, plan in plans.items():
        if plan.mode != "single":
            trainer = cluster.trainers[k]
            log.info(
                "round %d trainer %d: b_req %d, b_max %d -> %s plan %s",
                counters["round"] + 1,
                k,
                trainer.batch_size,
                cluster.b_max[trainer.worker_ids[0]],
                plan.mode,
                plan.sizes,
            )
    sync_every = cluster.inner_steps_per_round()
    steps = min(sync_every, math.ceil((config.total_tokens - counters["tokens"]) / per_step))
    return RoundPlan(
        index=counters["round"],
        steps=steps,
        first_step=counters["step"],
        tokens_before=counters["tokens"],
        per_step=per_step,
        plans=plans,
        started=time.perf_counter(),
        samples=cluster.samples_per_step(),
        sync_every=sync_every,
    )


def _after_step(run: RunState, plan: RoundPlan, progress: StepProgress, display: RunDisplay, stop: StopSignals) -> None:
    """After every inner step: a Ctrl-C that got lost stops the run here, else show the progress."""
    stop.raise_if_interrupted()
    _show_step(run, plan, progress, display)


def _show_step(run: RunState, plan: RoundPlan, progress: StepProgress, display: RunDisplay) -> None:
    """Progress after an inner step, from what this rank knows before the round's exchange."""
    if not run.is_root:
        return
    batch_label = ",".join(str(t.batch_size) for t in run.cluster.trainers.values())
    val = f" val {min(run.last_val.values()):.3f}" if run.last_val else ""
    trainers = len(run.cluster.trainers)
    status = f"loss {progress.loss:.3f}{val} b={batch_label}" + (f" K={trainers}" if trainers > 1 else "")
    status += f" H={plan.sync_every}" if run.config.auto_sync else ""
    status += f" MFU {run.last_mfu:.1%}" if run.last_mfu is not None else ""
    display.show(plan.index, plan.tokens_before + (progress.step + 1) * plan.per_step, status)


def _finish_round(run: RunState, plan: RoundPlan, report: RoundReport) -> None:
    """Everything after a round's training: merges, counters, evaluation, records, health, checkpoint."""
    cluster, counters = run.cluster, run.counters
    run.failed_streak = run.failed_streak + 1 if report.skipped else 0
    merge = cluster.maybe_merge(plan.index)
    traffic = gather_round_figures(run)
    settle(run)  # the previous round's record: its figures arrived while this round trained
    step_records = advance(run, plan, report)
    finished = counters["tokens"] >= run.config.total_tokens
    if finished:
        cluster.flush()  # exchanges still in flight count towards the final θ
    evaluated, eval_seconds = _evaluate(run, plan.index, finished)
    counters["seconds"] = time.perf_counter() - run.started
    record = round_record(run, plan, report, merge, evaluated, eval_seconds) if run.metrics is not None else {}
    run.last_mfu = record.get("mfu")
    run.pending = PendingRound(traffic, step_records, record, merge)
    checkpoint_due = not report.skipped and (_checkpoint_due(run, plan.index, report) or finished)
    if finished or checkpoint_due or run.failed_streak >= run.config.run.max_failed_rounds:
        settle(run)  # a checkpoint holds this round's byte count; the last round is recorded before the end
    if run.failed_streak >= run.config.run.max_failed_rounds:
        config = run.config
        raise NonFiniteError(
            f"training diverged: non-finite losses or gradients on every worker of a trainer for "
            f"{run.failed_streak} rounds in a row (round {plan.index + 1}); start a new run with a lower inner.lr "
            f"(now {config.inner.lr:g}) or outer.lr (now {config.outer.lr:g}), or a longer inner.warmup_steps "
            f"(now {config.inner.warmup_steps})"
        )
    if checkpoint_due:
        _checkpoint(run, plan.index + 1)


def _checkpoint_due(run: RunState, round_index: int, report: RoundReport) -> bool:
    """Every ``checkpoint.every`` rounds, and where some rank found ``checkpoint.every_minutes`` past."""
    return (round_index + 1) % run.config.checkpoint.every == 0 or report.request.checkpoint


def _checkpoint_time_due(run: RunState) -> bool:
    """This rank's clock says the time cadence is due (the round's reports make it the job's decision)."""
    minutes = run.config.checkpoint.every_minutes
    return minutes is not None and time.monotonic() - run.checkpointed_at >= 60 * minutes


def _evaluate(run: RunState, round_index: int, finished: bool) -> tuple[bool, float]:
    """Periodic validation of every trainer's θ on rank 0; its time is reported apart from training's."""
    evaluated = (round_index + 1) % run.config.eval.every == 0 or finished
    started = time.perf_counter()
    thetas = {k: run.cluster.full_theta(t) for k, t in run.cluster.trainers.items()} if evaluated else {}
    if evaluated and run.is_root:
        periodic = {k: run.task.evaluate(run.eval_model, theta, run.config.eval.blocks) for k, theta in thetas.items()}
        run.last_val.clear()
        run.last_val.update({k: e.loss for k, e in periodic.items()})
        run.last_accuracy = {k: e.accuracy for k, e in periodic.items() if e.accuracy is not None}
    return evaluated, time.perf_counter() - started


def _checkpoint(run: RunState, round_number: int) -> None:
    """A checkpoint of the state after round ``round_number`` (counted from 1, as everywhere a user sees it)."""
    run.last_checkpoint, run.checkpointed_at = round_number, time.monotonic()
    directory, keep = run.run_dir / "checkpoints", run.config.checkpoint.keep
    run_state = {"counters": dict(run.counters), "config": run.config.model_dump()} if run.is_root else {}
    if run.config.checkpoint.format == "sharded":  # collective: every rank writes its own workers
        from adloco.checkpoint.sharded import save_sharded_checkpoint  # DCP's import costs a second: only here

        part = {"cluster": run.cluster.local_state_dict(), **run_state}
        distributed = isinstance(run.comm, DistributedCommunicator)
        save_sharded_checkpoint(directory, round_number, part, keep, run.comm.rank, run.comm.barrier, distributed)
        return
    state = run.cluster.state_dict()  # collective: every rank hands its workers' state to rank 0
    if run.is_root:
        save_checkpoint(directory, round_number, {"cluster": state, **run_state}, keep=keep, kind=TRAIN)


def _finish(run: RunState, tokenizer_info: dict) -> TrainResult:
    """Final evaluation of every trainer, the summary, the export of the best θ and the plots (rank 0)."""
    config, comm, cluster, counters = run.config, run.comm, run.cluster, run.counters
    thetas = {k: cluster.full_theta(t) for k, t in cluster.trainers.items()}
    if not run.is_root:
        summary = comm.broadcast_object(None, src=0)
        return TrainResult(run_dir=run.run_dir, **summary)
    limit = None if config.eval.final_full else config.eval.blocks
    final_eval = {k: run.task.evaluate(run.eval_model, theta, limit) for k, theta in thetas.items()}
    final_val = {k: e.loss for k, e in final_eval.items()}
    best = min(final_val, key=final_val.get)
    seconds = time.perf_counter() - run.started
    result = TrainResult(
        run_dir=run.run_dir,
        val_loss=final_val[best],
        perplexity=math.exp(final_val[best]),
        tokens=counters["tokens"],
        rounds=counters["round"],
        seconds=seconds,
        bytes_sent=counters["bytes"],
        best_trainer=best,
        accuracy=final_eval[best].accuracy,
    )
    assert run.metrics is not None and run.eval_model is not None
    run.metrics.write(
        "final",
        round=counters["round"],
        val_loss=final_val,
        best_trainer=best,
        perplexity=result.perplexity,
        tokens=result.tokens,
        rounds=result.rounds,
        bytes_total=result.bytes_sent,
        seconds=seconds,
        **(
            {"accuracy": {k: e.accuracy for k, e in final_eval.items()}, "validation_samples": final_eval[best].count}
            if config.task == "classification"
            else {"validation_tokens": final_eval[best].count}
        ),
    )
    run.metrics.close()
    if config.run.save_final:
        export_final(run.eval_model, thetas[best], run.run_dir, tokenizer_info)
    if config.run.plots:
        _plot(run.run_dir)
    comm.broadcast_object({k: v for k, v in result.__dict__.items() if k != "run_dir"}, src=0)
    log.info(
        "done: val loss %.4f (perplexity %.2f), %d tokens, %.1f s",
        result.val_loss,
        result.perplexity,
        result.tokens,
        seconds,
    )
    return result


def _plot(run_dir: Path) -> None:
    from adloco.metrics.plots import plot_run

    try:
        plot_run(run_dir)
    except Exception as error:  # a plot must never cost a finished run
        log.warning("could not write plots: %s", error)
