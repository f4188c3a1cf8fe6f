"""A Hugging Face Trainer run made DiLoCo by one line. Byte-level LLaMA on a text file (default: the bundled
Tiny Shakespeare); each torchrun rank is one worker:

    torchrun --nproc_per_node=2 examples/hf_trainer.py --steps 200
"""

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from adloco import end_process_group
from adloco.data.sources import bundled_text
from adloco.integrations.hf import use_diloco


class Windows(torch.utils.data.Dataset):
    """Every ``context`` bytes of the text, as a causal-LM example (the model shifts the labels itself)."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) // self.context - 1

    def __getitem__(self, index: int) -> dict:
        window = self.data[index * self.context : (index + 1) * self.context]
        return {"input_ids": window, "labels": window}


def main(args: argparse.Namespace) -> None:
    text = Path(args.data).read_bytes() if args.data else bundled_text("tinyshakespeare").encode()
    data = torch.tensor(list(text))
    split = len(data) * 9 // 10
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, max_position_embeddings=args.context)  # fmt: skip
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=3, learning_rate=1e-3,
        weight_decay=0.1, warmup_steps=20, use_cpu=True, report_to=[], save_strategy="no", logging_steps=50,
        per_device_eval_batch_size=16, disable_tqdm=True, ddp_find_unused_parameters=False,
    )  # fmt: skip
    trainer = Trainer(
        model=LlamaForCausalLM(config), args=training, train_dataset=Windows(data[:split], args.context),
        eval_dataset=torch.utils.data.Subset(Windows(data[split:], args.context), range(64)),
    )  # fmt: skip
    use_diloco(trainer, sync_every=args.sync_every)  # the one line: each optimizer step is an inner step
    trainer.train()
    metrics = trainer.evaluate()  # of θ: the callback hands it to the model when training ends
    if trainer.is_world_process_zero():
        print(f"diloco: val loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--data", default=None, help="a text file (default: the bundled Tiny Shakespeare)")
    parser.add_argument("--out", default="hf-diloco", help="the Trainer's output folder")
    main(parser.parse_args())
    end_process_group()  # after main returned: the trainer's cycles hold the process group
