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

from adloco import DiLoCo, end_process_group, train_parts


def main(out: str, args: list[str]) -> None:
    stop_after = next((int(a.split("=")[1]) for a in args if a.startswith("--stop-after=")), None)
    overrides = [a for a in args if not a.startswith("--")]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = train_parts(overrides, worker=rank, workers=world)  # adloco train's model, AdamW, stream and schedule
    config, task, model, optimizer, stream = parts.config, parts.task, parts.model, parts.optimizer, parts.stream
    torch.set_num_threads(config.threads or 1)
    inner = config.inner
    group = dist.new_group(list(range(world))) if "--own-group" in args else None  # a group the user made
    diloco = DiLoCo(model, optimizer, process_group=group, **parts.diloco_settings())
    if diloco.batch:
        _adaptive_rounds(parts, diloco)
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
            parts.set_lr(step, step * per_step)
            optimizer.step()
    diloco.finish(into_model=False)  # every round is whole here: this applies the exchanges in flight
    if rank == 0:
        names = [name for name, _ in model.named_parameters()]
        torch.save(dict(zip(names, diloco.theta, strict=True)), out)


def _adaptive_rounds(parts, diloco) -> None:
    """Rounds whose batch the adaptive batch decides (each trainer its own); the budget cut as adloco train cuts
    it, in tokens over every trainer's workers."""
    config, task, model, optimizer, stream = parts.config, parts.task, parts.model, parts.optimizer, parts.stream
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
                parts.set_lr(step, tokens_before + round_step * per_step)
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
