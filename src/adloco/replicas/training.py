"""``adloco train`` as one fault-tolerant replica (``fault_tolerance.lighthouse`` given): one process, or with
``shards=S`` the S ranks of a torchrun job of its own (``adloco.replicas.shards``).

This process is worker ``fault_tolerance.replica`` of the job: the run's model, its own sample stream and the
inner optimizer, in a loop of ``adloco.DiLoCo(fault_tolerance=...)`` (the component a loop of one's own holds).
Each replica keeps its own run directory, ``run.root/<run.name or "replicas">/replica<i>``; one started again
with the same command finds it and appends to its ``metrics.jsonl``: one record per round (who took part, who was
absent, whether it committed, healed or had diverged, θ's validation loss every ``eval.every`` rounds) and the
final evaluation. A replica that joins heals from a peer and moves its sample stream to the peers' step, so
worker i reads at inner step s what it would have read had it never stopped: no sample twice, and the steps it
missed are never read. Every ``checkpoint.every`` rounds (or ``checkpoint.every_minutes``) a replica writes its
own checkpoint; one started again loads its newest before its first quorum, so a job whose replicas all died
goes on from their checkpoints (the replicas furthest on are the source the others heal from).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console

from adloco.algorithms.schedules import inner_lr
from adloco.algorithms.sharding import local_rows
from adloco.api import DiLoCo
from adloco.api.train_parts import diloco_arguments
from adloco.checkpoint import REPLICA, latest_checkpoint, save_checkpoint
from adloco.cluster.placement import resolve_device
from adloco.config import CheckpointConfig, ConfigError, EvalConfig, InnerConfig, RunConfig, TrainConfig
from adloco.data.tokenization import SAVED_DIR, save_tokenizer
from adloco.errors import CheckpointError, first_line
from adloco.metrics.writer import MetricsWriter, read_metrics
from adloco.models.precision import adamw_kernel
from adloco.run.directory import write_run_config
from adloco.run.runs import lock_run
from adloco.run.training import export_final
from adloco.workers.tasks import Task

if TYPE_CHECKING:
    from collections.abc import Callable

    from adloco.replicas.shards import ReplicaShards
    from adloco.sync.trainer import Trainer

log = logging.getLogger("adloco")
CHECKPOINTS = "checkpoints"  # a replica's checkpoints, in its run directory


def check_replica_run(resume: Path | None, torchrun: bool, *, shards: int, trainers: int, elastic: bool) -> None:
    """What ``adloco train`` as a replica cannot be, each as a one-line error: its ``shards``, ``trainers`` and
    ``elastic`` settings against how it was started (``resume``, ``torchrun``)."""
    from adloco.comm.distributed import world_size_from_env

    if shards > 1 and trainers > 1:
        raise ConfigError("fault_tolerance: a sharded worker's replicas run one trainer for now (trainers=1)")
    if shards > 1 and (not torchrun or world_size_from_env() != shards):
        raise ConfigError(f"fault_tolerance with shards={shards}: each replica is a torchrun job of its own "
                          f"{shards} ranks (torchrun --nproc_per_node={shards})")  # fmt: skip
    if torchrun and shards == 1:
        raise ConfigError("fault_tolerance: each replica is a process of its own; start it without torchrun")
    if resume is not None:
        raise ConfigError("--resume: a replica started again goes on from its own checkpoint, or heals from its "
                          "peers when they are further on; start it with the same command")  # fmt: skip
    if elastic:
        raise ConfigError("fault_tolerance: adloco train's replicas take elastic=false (the replicas are elastic)")


def replica_run_dir(run: RunConfig, replica: int) -> Path:
    """Replica ``replica``'s run directory under ``run.root``, the same for every start of it (its metrics go on in
    the same file)."""
    path = Path(run.root) / (run.name or "replicas") / f"replica{replica}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"run directory '{path}' cannot be created: {reason}") from None
    return path


@dataclass(frozen=True)
class _Settings:
    """What a replica's loop reads of the run's config, read once at the top (``train_replica``): which replica of
    how many it is, the seed, the token budget, b (and a sharded step's b_max), the inner, eval, checkpoint and
    run sections, and DiLoCo's arguments by name."""

    replica: int
    replicas: int
    seed: int
    total_tokens: int
    batch_size: int
    b_max: int | None
    inner: InnerConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    run: RunConfig
    diloco: dict[str, Any]


def train_replica(config: TrainConfig, task: Task, tokenizer: Any, console: Console) -> dict[str, Any]:
    """Train this replica to the token budget; the summary of the run (as ``adloco train`` prints it)."""
    ft = config.fault_tolerance
    assert ft.replica is not None
    run_dir = replica_run_dir(config.run, ft.replica)
    shards: ReplicaShards | None = None
    lock, error = None, None
    try:
        if config.shards > 1:
            from adloco.replicas.shards import ReplicaShards as Shards

            device, config.precision = resolve_device(config.device, config.precision, config.tf32)
            shards = Shards(config.shards, device, config.comm.timeout_s)
        if shards is None or shards.first:
            lock = lock_run(run_dir)
            write_run_config(run_dir, config.to_yaml())
            if not (run_dir / SAVED_DIR).exists():
                save_tokenizer(tokenizer, run_dir / SAVED_DIR)
        device, config.precision = resolve_device(config.device, config.precision, config.tf32)
        diloco = diloco_arguments(config, task.context, replica=True)
        settings = _Settings(ft.replica, ft.replicas, config.seed, config.total_tokens, config.batch.size,
                             config.batch.memory.b_max, config.inner, config.eval, config.checkpoint, config.run,
                             diloco)  # fmt: skip
        return {"run_dir": run_dir, **_train_in(settings, device, task, tokenizer.describe(), run_dir, console, shards)}
    except BaseException as raised:
        error = raised
        raise
    finally:
        if lock is not None:
            lock.release(error)
        if shards is not None:
            shards.close()


def _train_in(
    settings: _Settings,
    device: torch.device,
    task: Task,
    tokenizer_info: dict,
    run_dir: Path,
    console: Console,
    shards: ReplicaShards | None,
) -> dict:
    model = task.build_model(settings.seed)  # on the CPU: a sharded worker's rank holds only its rows on the device
    model = model.to(device) if shards is None else shards.shard(model, device)
    optimizer = _inner_optimizer(model, settings.inner, device)
    stream = task.worker_stream(settings.seed, settings.replica, settings.replicas)
    started = time.perf_counter()
    saved = _own_checkpoint(run_dir / CHECKPOINTS, model, optimizer, shards)
    try:
        diloco = DiLoCo(model, optimizer, **settings.diloco, state=None if saved is None else saved["diloco"])
    except ValueError as error:
        if saved is None:
            raise
        raise CheckpointError(f"{error} (the checkpoint in {run_dir / CHECKPOINTS})") from None
    assert diloco.replica is not None
    # went on from its own checkpoint (no peer further on): the rounds after it are trained again, so their
    # records from before go; after a heal the records stand (those rounds were the job's)
    resumed = saved is not None and not diloco.replica.healed
    speaks = shards is None or shards.first
    path = run_dir / "metrics.jsonl"
    metrics = MetricsWriter(path, resume_round=saved["round"] if resumed else None) if speaks else _Unwritten(path)
    try:
        loop = _ReplicaLoop(settings, task, stream, diloco, metrics, run_dir / CHECKPOINTS, shards)
        return _train_with(loop, settings, tokenizer_info, run_dir, console if speaks else None, started)
    finally:
        metrics.close()


class _Unwritten:
    """The records of a replica's other shards: its first one writes them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, kind: str, **fields: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _own_checkpoint(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shards: ReplicaShards | None
) -> dict | None:
    """This replica's newest checkpoint (a sharded worker's: the newest round all its ranks saved, each rank its
    own), with the model's and the inner optimizer's state loaded from it; None when it wrote none. DiLoCo's part
    is loaded before its first quorum."""
    if shards is not None:
        return shards.restore(directory, model, optimizer)[1]
    saved = latest_checkpoint(directory, kind=REPLICA)
    if saved is None:
        return None
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise CheckpointError(f"the checkpoint in {directory} is another model's ({first_line(error)})") from None
    return saved


def _train_with(
    loop: _ReplicaLoop,
    settings: _Settings,
    tokenizer_info: dict,
    run_dir: Path,
    console: Console | None,
    started: float,
) -> dict:
    """The replica's rounds, then its final record (and export) of θ. ``console`` None: a sharded worker's rank
    other than its first, which trains and takes part in gathering θ but writes nothing."""
    task, diloco, metrics, run = loop.task, loop.diloco, loop.metrics, settings.run
    if run.progress and console is not None:
        console.print(f"adloco: replica {settings.replica} of {settings.replicas} at step {diloco.inner_step}, run "
                      f"directory {run_dir}", markup=False, highlight=False, soft_wrap=True)  # fmt: skip
    loop.run(console if run.progress else None)
    diloco.finish()  # the model is θ now
    loop.write_rounds(last=True)
    theta = loop.whole_theta(diloco.trainer)
    sent = loop.bytes_before + loop.bytes_sent()
    seconds = time.perf_counter() - started
    summary = {"tokens": loop.tokens, "rounds": diloco.rounds.count, "seconds": seconds}
    if console is None:
        return {**summary, "val_loss": math.nan}
    limit = None if settings.eval.final_full else settings.eval.blocks
    final = task.evaluate(loop.eval_model, theta, limit)
    summary.update(val_loss=final.loss, perplexity=math.exp(final.loss), accuracy=final.accuracy)
    own = diloco.trainer.trainer_id  # by trainer, as adloco train's final record (this replica's θ is its own's)
    metrics.write("final", **{**summary, "val_loss": {own: final.loss}}, best_trainer=own, replica=settings.replica,
                  steps=diloco.inner_step, samples_read=loop.read, bytes_total=sent)  # fmt: skip
    if run.save_final:
        export_final(loop.eval_model, theta, run_dir, tokenizer_info)
    return summary


def _inner_optimizer(model: torch.nn.Module, inner: InnerConfig, device: torch.device) -> torch.optim.Optimizer:
    from adloco.workers.inner_optimizer import inner_optimizer

    return inner_optimizer(model, inner, adamw_kernel(device))


class _ReplicaLoop:
    """The inner steps of one replica: its stream at DiLoCo's step, the scheduled lr, a record per round. With
    ``method=adloco`` the adaptive batch decides how many samples a step reads and the budget ends the run."""

    def __init__(
        self,
        settings: _Settings,
        task: Task,
        stream: Any,
        diloco: DiLoCo,
        metrics: MetricsWriter | _Unwritten,
        checkpoints: Path,
        shards: ReplicaShards | None = None,
    ) -> None:
        self.settings, self.task, self.model, self.optimizer = settings, task, diloco.model, diloco.optimizer
        self.stream, self.diloco, self.metrics, self.checkpoints = stream, diloco, metrics, checkpoints
        self.shards = shards  # the ranks of a sharded worker; its first one writes
        self.device = local_rows(next(self.model.parameters())).device
        self.speaks = shards is None or shards.first  # a sharded worker's first rank writes and evaluates
        # θ is evaluated apart from the worker
        self.eval_model = task.build_model(settings.seed).to(self.device) if self.speaks else None
        self.val: dict[int, dict[int, float]] = {}  # rounds (from 1) evaluated, by trainer, not yet in a record
        self.b = settings.batch_size
        self.per_step = settings.replicas * self.b * task.context  # tokens per step, all present
        self.total_steps = math.ceil(settings.total_tokens / self.per_step)
        self.read = 0  # samples this worker's stream has handed out
        self.written = 0  # rounds of diloco.replica.history in metrics.jsonl
        self.merges_written = 0  # of diloco.merges (several trainers)
        self.losses: list[float | torch.Tensor] = []  # a step's loss stays on its device until its round's record
        self.loss_trainer = diloco.trainer.trainer_id  # the trainer the losses are of
        self.tokens = 0
        # the bytes this replica sent, over its lives: on from its metrics' last round record
        self.bytes_before = _last_bytes_total(metrics.path) if self.speaks else 0
        self.bytes_recorded = 0  # of diloco.comm.stats.bytes_sent, in the records written
        self.shown = self.saved_at = time.monotonic()

    def run(self, console: Console | None) -> None:
        with self.diloco:
            if not self.diloco.batch:
                while self.diloco.inner_step < self.total_steps:
                    step = self.diloco.inner_step
                    fraction = step * self.per_step / self.settings.total_tokens
                    self._step(self.b, step, fraction, console)
            else:
                self._adaptive_rounds(console)

    def _adaptive_rounds(self, console: Console | None) -> None:
        """Rounds of the batch the adaptive batch asks for; the budget (in tokens, over the workers present) cuts
        the last one short, as adloco train's does."""
        batch, context, total = self.diloco.batch, self.task.context, self.settings.total_tokens
        assert batch
        while batch.samples_done * context < total:
            self._catch_up()  # a heal (at the start, or at this round's quorum) moves the stream
            tokens_before, per_step = batch.samples_done * context, batch.job_samples * context
            length = self.diloco.rounds.length  # this round's H (sync_every=auto: the next one's is chosen at its end)
            steps = min(length, math.ceil((total - tokens_before) / per_step))
            for round_step in range(steps):
                fraction = (tokens_before + round_step * per_step) / total
                self._step(batch.samples, self.diloco.inner_step, fraction, console)
            if steps < length:
                break  # finish() ends this shorter round

    def _step(self, samples: int, step: int, fraction: float, console: Console | None) -> None:
        """One inner step of ``samples`` samples at inner step ``step``, ``fraction`` into the budget."""
        if not self.diloco.batch:
            self._catch_up()
        data = [t.to(self.device) for t in self.stream.next_batch(samples)]
        self.read += samples
        self.optimizer.zero_grad(set_to_none=True)
        if self.diloco.batch:  # in micro-batches of b_max (a sharded worker: this rank's share of
            # each); on a statistics step in groups, for the batch test
            self.losses.append(self.diloco.batch.backward(lambda *xs: self.task.loss(self.model, *xs), *data))
        elif self.shards is not None:  # this rank's share of the step, as adloco train shards=S splits it
            b_max = self.settings.b_max or samples
            self.losses.append(self.shards.backward(self._loss_of(data), samples, b_max))
        else:
            loss = self.task.loss(self.model, *data)
            loss.backward()
            self.losses.append(loss.detach())  # no wait for the GPU every step
        inner = self.settings.inner
        if inner.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), inner.clip, foreach=False)
        lr = inner_lr(step, fraction, inner.lr, inner.min_lr, inner.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rounds = self.diloco.rounds.count
        self.loss_trainer = self.diloco.trainer.trainer_id  # whose round this is (a merge at its end moves it)
        self.optimizer.step()  # DiLoCo's hook: a round's end, its exchange, the next quorum (maybe a heal)
        if self.diloco.rounds.count != rounds:
            self._evaluate_if_due()
            self._checkpoint_if_due()
        self.write_rounds()
        if console is not None and time.monotonic() - self.shown >= self.settings.run.progress_every_s:
            self.shown = time.monotonic()
            console.print(self._progress(), markup=False, highlight=False, soft_wrap=True)

    def _loss_of(self, data: list[torch.Tensor]) -> Callable[[int, int], torch.Tensor]:
        return lambda offset, size: self.task.loss(self.model, *(t[offset : offset + size] for t in data))

    def whole_theta(self, trainer: Trainer) -> list[torch.Tensor] | None:
        """``trainer``'s θ whole; a sharded worker's ranks all take part in gathering it onto the first, the
        others get None."""
        rows = [t.detach() for t in trainer.theta]
        return rows if self.shards is None else self.shards.whole(self.model, rows)

    def bytes_sent(self) -> int:
        """The bytes of this replica's exchanges (a sharded worker's: every rank's rows)."""
        sent = self.diloco.comm.stats.bytes_sent
        return sent if self.shards is None else int(self.shards.total(sent))

    def _evaluate_if_due(self) -> None:
        """Each trainer's θ after the round that just ended on ``eval.blocks`` validation blocks, every
        ``eval.every`` rounds (as adloco train's periodic evaluation)."""
        count, replica, blocks = self.diloco.rounds.count, self.diloco.replica, self.settings.eval.blocks
        assert replica is not None
        if count % self.settings.eval.every == 0 and not replica.healed:  # healed: the peers' round, not in a record
            thetas = {k: self.whole_theta(trainer) for k, trainer in self.diloco.trainers.items()}
            if self.eval_model is not None:
                self.val[count] = {k: self.task.evaluate(self.eval_model, theta, blocks).loss
                                   for k, theta in thetas.items() if theta is not None}  # fmt: skip

    def _checkpoint_if_due(self) -> None:
        """This replica's state at a round's end (its next quorum formed), every ``checkpoint.every`` rounds or
        ``checkpoint.every_minutes``: DiLoCo's (θ, outer state, counters, torchft's step), the model's and the
        inner optimizer's. Written atomically; the stream needs nothing (it reads on from the step)."""
        every, minutes = self.settings.checkpoint.every, self.settings.checkpoint.every_minutes
        count = self.diloco.rounds.count
        late = minutes is not None and time.monotonic() - self.saved_at >= 60 * minutes
        if self.shards is not None and minutes is not None:  # the ranks of a sharded worker save the same rounds
            late = self.shards.any(late)
        if count % every and not late:
            return
        keep = self.settings.checkpoint.keep
        self.checkpoints.mkdir(exist_ok=True)
        if self.shards is None:
            state = {"diloco": self.diloco.state_dict(), "model": self.model.state_dict(),
                     "optimizer": self.optimizer.state_dict()}  # fmt: skip
            save_checkpoint(self.checkpoints, count, state, keep, kind=REPLICA)
        else:  # each rank its own rows
            self.shards.save(self.checkpoints, count, keep, diloco=self.diloco.state_dict(), model=self.model,
                             optimizer=self.optimizer)  # fmt: skip
        self.saved_at = time.monotonic()

    def _catch_up(self) -> None:
        """After a heal the step is the peers': read past the samples of the steps this worker did not take."""
        batch = self.diloco.batch
        target = self.diloco.inner_step * self.b if not batch else batch.worker_samples
        if hasattr(self.stream, "skip") and self.read < target:  # token files: the cursor moves, nothing is read
            self.stream.skip(target - self.read)
            self.read = target
        while self.read < target:
            size = min(target - self.read, 4096)
            self.stream.next_batch(size)
            self.read += size

    def write_rounds(self, last: bool = False) -> None:
        """A record for each round whose exchange is over (at the end, the last one too)."""
        replica = self.diloco.replica
        assert replica is not None
        done = len(replica.history) if last else len(replica.history) - 1
        if done <= self.written:
            return  # mid-round: nothing to write (this runs after every inner step)
        batch = self.diloco.batch
        for record in replica.history[self.written : done]:  # the job's tokens, as adloco train counts them
            first = record is replica.history[0]  # of this start: its recovery, process start to here
            age = {"process_seconds": process_age()} if first and record.committed else {}
            self.tokens = (
                self.diloco.inner_step * self.per_step if not batch else batch.samples_done * self.task.context
            )
            loss = sum(float(x) for x in self.losses) / len(self.losses) if self.losses else None
            fields = {**asdict(record), "round": record.round + 1, **self._bytes()}
            fields["val_loss"] = self.val.pop(record.round + 1, None)  # by trainer, as adloco train's records
            train_loss = None if loss is None else {self.loss_trainer: loss}
            self.metrics.write("round", **fields, step=self.diloco.inner_step, tokens=self.tokens,
                               train_loss=train_loss, replica=replica.comm.rank, **age)  # fmt: skip
            self.losses = []
            merges = self.diloco.merges[self.merges_written :]
            for event in (m for m in merges if m.round == record.round + 1):  # after its round, as adloco train's
                self.metrics.write("merge", **event.to_dict())
                self.merges_written += 1
        self.metrics.flush()
        self.written = done

    def _bytes(self) -> dict[str, int]:
        """The bytes of the exchanges since the last record (``bytes``) and over this replica's lives
        (``bytes_total``), counted as a plain run counts them: every present worker's row once (what a network of
        one worker per machine carries); rounds this replica missed are not in them."""
        sent = self.bytes_sent()
        recorded, self.bytes_recorded = sent - self.bytes_recorded, sent
        return {"bytes": recorded, "bytes_total": self.bytes_before + sent}

    def _progress(self) -> str:
        replica = self.diloco.replica
        assert replica is not None
        last = replica.history[-2] if len(replica.history) > 1 else replica.history[-1]
        return (f"adloco: replica {replica.comm.rank}: step {self.diloco.inner_step}/{self.total_steps}, round "
                f"{self.diloco.rounds.count} (H={self.diloco.rounds.length}), {last.participants} replicas in the "
                "last round")  # fmt: skip


def _last_bytes_total(path: Path) -> int:
    """The ``bytes_total`` of the last round record in a replica's metrics (0 for none): a replica started again
    counts on from it."""
    if not path.exists():
        return 0
    rounds = [r for r in read_metrics(path) if r.get("kind") == "round"]
    value = rounds[-1].get("bytes_total") if rounds else None
    return value if isinstance(value, int) else 0


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), or None where that cannot be read."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
