"""A plain PyTorch loop with ``adloco.DiLoCo``, reading the very samples and settings ``adloco train`` would.

Run under torchrun by tests/api/test_diloco.py: ``python -m torch.distributed.run ... adloco_train_loop.py OUT
[--stop-after=N] [--own-group] key=value ...``. Each rank builds the run's model, its worker's sample stream and
AdamW as the command line does, then trains its own loop: loss, backward, clipping, the scheduled lr,
``optimizer.step()``.
Rank 0 writes θ by parameter name into OUT (torch.save), to be compared with the exported model of
``adloco train``. ``--stop-after=N`` stops after N inner steps with every rank's own checkpoint (model, optimizer,
stream, DiLoCo) in ``OUT.rank<r>``; a launch with the same OUT then resumes from it. ``--own-group``: DiLoCo
exchanges over a process group the loop made rather than the default group. With ``method=adloco`` the loop asks
``diloco.batch`` how many samples each step reads, lets it run the backward (groups on a statistics step) and
ends its last, shorter round with ``finish``, as ``adloco train`` ends on its token budget.
"""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from adloco import DiLoCo, build_config, end_process_group
from adloco.algorithms.schedules import inner_lr
from adloco.data import build_tokenizer, load_corpus, source_from_config, training_texts
from adloco.tasks import build_task

STREAM_SEED_STRIDE = 1_000_003  # as adloco train spreads its workers' streams


def main(out: str, args: list[str]) -> None:
    stop_after = next((int(a.split("=")[1]) for a in args if a.startswith("--stop-after=")), None)
    overrides = [a for a in args if not a.startswith("--")]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = build_config(overrides=overrides)
    torch.set_num_threads(config.threads or 1)
    source = source_from_config(config.data)
    tokenizer = build_tokenizer(config.data, training_texts(config.data, source))
    task = build_task(config, tokenizer, lambda context: load_corpus(config.data, tokenizer, context, source))
    model = task.build_model(config.seed)
    stream = task.stream(config.seed * STREAM_SEED_STRIDE + rank, worker=rank, workers=world)
    inner = config.inner
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": inner.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps, foreach=False)
    sections = {"outer": config.outer.model_dump(), "streaming": config.streaming.model_dump()}
    if config.method != "streaming":
        sections.pop("streaming")
    group = dist.new_group(list(range(world))) if "--own-group" in args else None  # a group the user made
    if config.method == "adloco":
        sections["batch"] = config.batch.model_dump()
    if config.trainers > 1:
        sections["merge"] = config.merge.model_dump()
    if config.sync_every == "auto":
        sections["sync_auto"] = config.sync_auto.model_dump()
    diloco = DiLoCo(
        model, optimizer, config.sync_every, config.method, codec=config.codec.model_dump(), process_group=group,
        total_samples=config.total_tokens // task.context, trainers=config.trainers, **sections,
    )  # fmt: skip
    if diloco.batch:
        _adaptive_rounds(config, task, model, optimizer, stream, diloco, world)
        if rank == 0:
            names = [name for name, _ in model.named_parameters()]
            torch.save(dict(zip(names, diloco.theta, strict=True)), out)
        return

    per_step = world * config.batch.size * task.context
    mine = Path(f"{out}.rank{rank}")
    first = 0
    if mine.exists():  # a checkpoint of this loop's own: resume from it
        saved = torch.load(mine, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        stream.load_state_dict(saved["stream"])
        diloco.load_state_dict(saved["diloco"])
        first = saved["step"]
    with diloco:
        for step in range(first, math.ceil(config.total_tokens / per_step)):
            if step == stop_after:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save({**state, "stream": stream.state_dict(), "diloco": diloco.state_dict()}, mine)
                return
            inputs, targets = stream.next_batch(config.batch.size)
            optimizer.zero_grad(set_to_none=True)
            task.loss(model, inputs, targets).backward()
            if inner.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), inner.clip, foreach=False)
            lr = inner_lr(step, step * per_step / config.total_tokens, inner.lr, inner.min_lr, inner.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
    diloco.finish(into_model=False)  # every round is whole here: this applies the exchanges in flight
    if rank == 0:
        names = [name for name, _ in model.named_parameters()]
        torch.save(dict(zip(names, diloco.theta, strict=True)), out)


def _adaptive_rounds(config, task, model, optimizer, stream, diloco, world: int) -> None:
    """Rounds whose batch the adaptive batch decides (each trainer its own); the budget cut as adloco train cuts
    it, in tokens over every trainer's workers."""
    inner, batch, step = config.inner, diloco.batch, 0
    with diloco:
        while batch.samples_done * task.context < config.total_tokens:
            tokens_before, per_step = batch.samples_done * task.context, batch.job_samples * task.context
            length = diloco.rounds.length  # H of this round (sync_every=auto: chosen with b at the last one's end)
            steps = min(length, math.ceil((config.total_tokens - tokens_before) / per_step))
            for round_step in range(steps):
                inputs, targets = stream.next_batch(batch.samples)
                optimizer.zero_grad(set_to_none=True)
                batch.backward(lambda x, y: task.loss(model, x, y), inputs, targets)
                if inner.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), inner.clip, foreach=False)
                fraction = (tokens_before + round_step * per_step) / config.total_tokens
                lr = inner_lr(step, fraction, inner.lr, inner.min_lr, inner.warmup_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                step += 1
            if steps < length:
                break  # the budget cut this round short: its steps cover what was left
    diloco.finish(into_model=False)  # a last round the budget cut short ends here, as adloco train's does
    if config.trainers > 1:
        assert diloco.merges, "the trainers were to merge"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    end_process_group()
