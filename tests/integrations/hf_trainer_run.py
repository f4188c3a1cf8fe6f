"""A transformers.Trainer run made DiLoCo, and the same training as a plain loop, under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 hf_trainer_run.py OUT MODE [OUT MODE ...]

MODE is one of trainer, resume, loop; the runs one after another in one launch.

``trainer``: Trainer.train() with ``use_diloco``, saving a checkpoint mid-round (after step 6 of 4-step rounds);
``resume``: the same run resumed from that checkpoint (OUT names the first run's files); ``loop``: a plain loop over
the Trainer's own dataloader, optimizer, scheduler and loss (``compute_loss``) with ``adloco.DiLoCo``. Rank 0
writes θ by name into OUT and every rank its first parameter's sum after every inner step into OUT.rank<r> (drift
within a round).
"""

import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from adloco import DiLoCo, end_process_group
from adloco.data.sources import bundled_text
from adloco.integrations.hf import use_diloco

CONTEXT, STEPS, SYNC_EVERY, SAVE_AT = 16, 12, 4, 6


class Windows(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        data = torch.tensor(list(bundled_text("tinyshakespeare")[:20000].encode()))
        self.rows = [data[i * 97 : i * 97 + CONTEXT] for i in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class Drift(TrainerCallback):
    """The first parameter's sum after every optimizer step (within a round the ranks' models differ)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.sums.append(float(next(model.parameters()).sum()))


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=CONTEXT)  # fmt: skip
    return LlamaForCausalLM(config)


def main(out: str, mode: str) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    args = TrainingArguments(
        output_dir=f"{out}.hf", per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-3,
        use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True, seed=0,
        average_tokens_across_devices=False, dataloader_num_workers=0, ddp_find_unused_parameters=False,
        save_strategy="steps" if mode == "trainer" else "no", save_steps=SAVE_AT,  # mid-round: 6 = 1.5 rounds
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Windows(64))
    drift = Drift()
    if mode in ("trainer", "resume"):
        trainer.add_callback(drift)
        callback = use_diloco(trainer, sync_every=SYNC_EVERY)
        trainer.train(resume_from_checkpoint=f"{out}.hf/checkpoint-{SAVE_AT}" if mode == "resume" else None)
        theta = callback.diloco.theta
    else:
        loader = trainer.get_train_dataloader()
        trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        with DiLoCo(model, optimizer, sync_every=SYNC_EVERY) as diloco:
            for _, batch in zip(range(STEPS), loader, strict=False):
                trainer.compute_loss(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                model.zero_grad()
                drift.sums.append(float(next(model.parameters()).sum()))
        diloco.finish()
        theta = diloco.theta
    rank = dist.get_rank()
    target = f"{out}.resumed" if mode == "resume" else out
    torch.save(drift.sums, f"{target}.rank{rank}")
    if rank == 0:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        torch.save(dict(zip(names, [t.detach().clone() for t in theta], strict=True)), target)
    dist.barrier()


if __name__ == "__main__":
    for out, mode in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
        main(out, mode)
    end_process_group()
