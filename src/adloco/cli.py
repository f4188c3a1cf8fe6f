"""Command line: ``adloco train [CONFIG.yaml] [key=value ...] [--resume RUN_DIR]``."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from adloco import __version__

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as for every bad input
        self.exit(EXIT_USAGE, f"adloco: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="adloco", description="Low-communication distributed training of language models.")
    parser.add_argument("--version", action="version", version=f"adloco {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train a model (default: DiLoCo, 4 workers, tiny LLaMA, Shakespeare)")
    train.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml] key=value",
        help="an optional YAML config file followed by overrides such as method=adloco inner.lr=2e-3",
    )
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    evaluate = commands.add_parser("eval", help="validation loss and perplexity of a run's exported model")
    evaluate.add_argument("run_dir", metavar="RUN_DIR")
    sample = commands.add_parser("sample", help="generate text with a run's exported model")
    sample.add_argument("run_dir", metavar="RUN_DIR")
    sample.add_argument("--prompt", default="", help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token")
    sample.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    sample.add_argument("--seed", type=int, default=0)
    plot = commands.add_parser("plot", help="write PNG plots of a run (loss vs tokens, rounds, bytes; b per trainer)")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    return parser


def _split_items(items: list[str]) -> tuple[str | None, list[str]]:
    config_file = None
    overrides = []
    for index, item in enumerate(items):
        if index == 0 and "=" not in item:
            config_file = item
        else:
            overrides.append(item)
    return config_file, overrides


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from adloco.checkpoint import CheckpointError
    from adloco.config import ConfigError, load_config
    from adloco.data import DataError

    try:
        if args.command == "train":
            return _train(args, load_config)
        if args.command in ("eval", "sample", "plot"):
            return _use_run(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"adloco: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as error:
        from adloco.comm.distributed import launched_by_torchrun
        from adloco.training import NonFiniteError

        if isinstance(error, NonFiniteError):
            print(f"adloco: error: {error}", file=sys.stderr)
            return 1

        if not launched_by_torchrun():
            raise
        # A dead or hung peer surfaces as a failed or timed-out collective; say so instead of a traceback.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        rank = os.environ.get("RANK", "?")
        print(
            f"adloco: error: rank {rank} lost contact with the other ranks ({first_line[:200]}); "
            "the job stops here; resume with --resume RUN_DIR from the last checkpoint",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("adloco: interrupted; resume with --resume RUN_DIR from the last checkpoint", file=sys.stderr)
        return 130
    return 0


def _use_run(args: argparse.Namespace) -> int:
    from adloco.checkpoint import CheckpointError
    from adloco.inference import evaluate_run, sample

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory '{run_dir}' does not exist")
    if args.command == "plot":
        from adloco.plots import plot_run

        for path in plot_run(run_dir):
            print(path)
        return 0
    if args.command == "eval":
        loss, tokens = evaluate_run(run_dir)
        print(f"validation loss {loss:.4f} (perplexity {math.exp(loss):.3f}) over {tokens:,} tokens")
    else:
        print(sample(run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0


def _train(args: argparse.Namespace, load_config) -> int:
    from rich.console import Console

    from adloco.config import ConfigError
    from adloco.training import resume_config, train

    config_file, overrides = _split_items(args.items)
    if args.resume:
        if config_file or overrides:
            raise ConfigError("--resume continues a run with its own config; give no config file or overrides")
        run_dir = Path(args.resume)
        config = resume_config(run_dir)
    else:
        run_dir = None
        config = load_config(config_file, overrides)
    console = Console(stderr=True)
    result = train(config, resume=run_dir, console=console)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun rank 0 speaks for the job
    print(f"run directory: {result.run_dir}")
    print(
        f"final validation loss {result.val_loss:.4f} (perplexity {result.perplexity:.3f}) "
        f"after {result.tokens:,} tokens, {result.rounds} rounds, {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
