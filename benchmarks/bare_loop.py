"""The same training as `adloco train method=ddp workers=1`, written as a bare PyTorch loop.

    python benchmarks/bare_loop.py --steps 200 --batch 12

Same model, initialisation, data stream, AdamW groups and clipping; prints the steady-state tokens/s as JSON
(the first `--warmup` steps are not timed). Used by benchmarks/suite.py to measure adloco's overhead.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from adloco.config import InnerConfig
from adloco.data import Corpus, TokenStream, get_tokenizer
from adloco.models.build import build_model, next_token_loss, preset_config

# The stream seed adloco gives worker 0 with seed 0 (see adloco/cluster/cluster.py).
STREAM_SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    inner = InnerConfig()
    tokenizer = get_tokenizer("byte")
    config = preset_config("tiny", tokenizer.vocab_size)
    context = int(config.max_position_embeddings)
    corpus = Corpus.load("tinyshakespeare", tokenizer, 0.1, context)
    model = build_model(config, seed=0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
        foreach=False,
    )
    stream = TokenStream(corpus.train, context, seed=STREAM_SEED)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        inputs, targets = stream.next_batch(args.batch)
        loss = next_token_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, inner.clip, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a host sync per step, as any loop that logs its loss has
    seconds = time.perf_counter() - started
    print(json.dumps({"tokens_per_second": args.steps * args.batch * context / seconds, "seconds": seconds}))


if __name__ == "__main__":
    main()
