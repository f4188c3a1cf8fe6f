"""Command line: ``adloco train [CONFIG.yaml] [key=value ...] [--resume RUN_DIR]``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from adloco import __version__
from adloco.errors import RenamedSettingWarning, first_line

if TYPE_CHECKING:  # the command line imports these when a command needs them
    from rich.console import Console

    from adloco.config import TrainConfig

EXIT_USAGE = 2


def _one_line(message: object) -> str:
    """An error message on one line even when it quotes user input holding line breaks, and printable even when
    that input holds what no encoding can write (a lone surrogate from an undecodable argument)."""
    text = str(message).replace("\r", "\\r").replace("\n", "\\n")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as for every bad input
        self.exit(EXIT_USAGE, f"adloco: error: {_one_line(message)}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="adloco", description="Low-communication distributed training of language models.")
    parser.add_argument("--version", action="version", version=f"adloco {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(commands)
    _add_prepare(commands)
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
    runs = commands.add_parser("runs", help="list the runs under a folder: method, status, tokens, rounds, val loss")
    runs.add_argument("root", metavar="ROOT", nargs="?", default="runs", help="folder of run directories (runs)")
    runs.add_argument("--json", action="store_true", help="one JSON object per run and line instead of a table")
    gradients = commands.add_parser(
        "gradients", help="gradient noise of a run: tr Cov, noise scale, batch-gradient deviation vs batch size"
    )
    gradients.add_argument("run_dir", metavar="RUN_DIR")
    gradients.add_argument(
        "--checkpoint", default=None, help="'final' (default when exported), 'latest' or a checkpoint round number"
    )
    gradients.add_argument("--trainer", type=int, default=None, help="trainer of a checkpoint (default: best/first)")
    gradients.add_argument("--samples", type=int, default=128, help="training windows N (default 128)")
    gradients.add_argument(
        "--batch-sizes", default=None, help="comma-separated B (default 1,2,4,8,16,32, those <= --samples)"
    )
    gradients.add_argument("--repeats", type=int, default=1000, help="random batches per B (default 1000)")
    gradients.add_argument("--seed", type=int, default=0, help="seed of the windows and batches (default 0)")
    gradients.add_argument("--out", default=None, help="output folder (default RUN_DIR/gradients)")
    gradients.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the run's)")
    estimate = commands.add_parser(
        "estimate", help="predict the rounds a run needs to reach a target loss from its gradient statistics"
    )
    estimate.add_argument("run_dir", metavar="RUN_DIR")
    estimate.add_argument("--target", type=float, required=True, metavar="LOSS", help="training loss to reach")
    estimate.add_argument(
        "--calibrate-rounds", type=int, default=None, metavar="N", help="rounds to calibrate on (default: first 20%%)"
    )
    estimate.add_argument("--trainer", type=int, default=None, help="trainer to follow (default: the final best)")
    estimate.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_lighthouse(commands)
    return parser


def _add_lighthouse(commands) -> None:
    lighthouse = commands.add_parser(
        "lighthouse", help="run the torchft Lighthouse that forms fault-tolerant replicas' quorums, until stopped"
    )
    lighthouse.add_argument("--host", default="::", help="address to listen on (default :: , every interface)")
    lighthouse.add_argument("--port", type=int, default=29510, help="port to listen on (default 29510; 0: any free)")
    lighthouse.add_argument(
        "--min-replicas", type=int, default=1, help="the fewest replicas a quorum forms with (default 1)"
    )
    lighthouse.add_argument(
        "--join-timeout", type=float, default=2.0, metavar="S",
        help="grace for a replica of the last quorum that has not asked for the next one yet (default 2 s)",
    )  # fmt: skip
    lighthouse.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, metavar="S",
        help="a replica silent for this long is taken for dead and not waited for (default 5 s)",
    )  # fmt: skip


def _count(text: str) -> int:
    """A whole number, also written as 1e8 or 100_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _add_prepare(commands) -> None:
    from adloco.data.prepare import PrepareSettings

    default = PrepareSettings("")
    prepare = commands.add_parser(
        "prepare", help="tokenize a corpus once into token shards that training reads (data.dataset=DIR)"
    )
    prepare.add_argument("source", metavar="SOURCE", help="a text file, folder, .jsonl, .parquet or hf:NAME")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder to write (run again to resume)")
    prepare.add_argument("--tokenizer", default=default.tokenizer,
                         help="bpe (trained here, default), byte, a tokenizer folder or hf:NAME")  # fmt: skip
    prepare.add_argument("--vocab-size", type=_count, default=default.vocab_size, help="bpe: vocabulary (32768)")
    prepare.add_argument("--bpe-chars", type=_count, default=default.bpe_chars,
                         help="bpe: train on at most this many characters (1e8)")  # fmt: skip
    prepare.add_argument("--bpe-every", type=_count, default=default.bpe_every,
                         help="bpe: train on every K-th training document, spreading the sample (1)")  # fmt: skip
    prepare.add_argument("--shard-tokens", type=_count, default=default.shard_tokens,
                         help="tokens per shard (1e8)")  # fmt: skip
    prepare.add_argument("--val-documents", type=_count, default=default.val_documents,
                         help="documents held out for validation at most (1000)")  # fmt: skip
    prepare.add_argument("--val-every", type=_count, default=default.val_every,
                         help="hold out every K-th document until --val-documents are (100)")  # fmt: skip
    prepare.add_argument("--val-fraction", type=float, default=default.val_fraction,
                         help="a single text file: its trailing fraction for validation (0.1)")  # fmt: skip
    prepare.add_argument("--text-field", default=default.text_field, help="JSON Lines/Parquet/dataset field (text)")
    prepare.add_argument("--hf-config", default=None, help="Hugging Face dataset configuration")
    prepare.add_argument("--hf-data-files", default=None, help="data_files for datasets.load_dataset")
    prepare.add_argument("--split", default=default.split, help="Hugging Face dataset split (train)")
    prepare.add_argument("--suffixes", default=",".join(default.suffixes),
                         help="a folder's files to read, by suffix ('*': all; unreadable ones skipped)")  # fmt: skip
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    prepare.add_argument("--processes", type=_count, default=usable,
                         help="tokenizing processes (default: the CPUs this process may use)")  # fmt: skip
    prepare.add_argument("-q", "--quiet", action="store_true", help="no progress; errors and the result only")


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="train a model (default: DiLoCo, 4 workers, tiny LLaMA, Shakespeare)")
    train.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml] key=value",
        help="an optional YAML config file followed by overrides such as method=adloco inner.lr=2e-3",
    )
    train.add_argument(
        "--print-config",
        nargs="?",
        const="basic",
        choices=["basic", "all"],
        help="print the resolved basic settings and exit; --print-config=all prints every setting",
    )
    loudness = train.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true", help="no progress; errors and the result only")
    loudness.add_argument("-v", "--verbose", action="store_true", help="also show what train.log records")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its last checkpoint; overrides may change the budget, cadences and run options",
    )


def _split_items(items: list[str]) -> tuple[str | None, list[str]]:
    config_file = None
    overrides = []
    for index, item in enumerate(items):
        if index == 0 and "=" not in item:
            config_file = item
        else:
            overrides.append(item)
    return config_file, overrides


def _check_config_file(name: str, rest: list[str]) -> None:
    """A missing config file that looks like a key (``workers 4``) is answered with how keys are written."""
    from adloco.config import ConfigError

    if Path(name).exists() or Path(name).suffix.lower() in (".yaml", ".yml", ".json"):
        return  # load_config reads it, or says that it does not exist
    value = rest[0] if rest and "=" not in rest[0] else "VALUE"
    raise ConfigError(f"config file {name!r} does not exist; settings are written key=value, e.g. {name}={value}"[:300])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A bare --print-config must not take the override after it as its value: it means the basic tier.
    args = _parser().parse_args(["--print-config=basic" if a == "--print-config" else a for a in argv])
    try:
        with _notes_on_one_line():
            return _command(args)
    finally:
        # A torchrun rank that ended in an error left reference cycles (a sharded model's process groups among
        # them) that would otherwise be freed at interpreter exit, where gloo's threads may abort the process.
        # Only there: a full collection of torch's heap costs a good part of a second.
        distributed = sys.modules.get("adloco.comm.distributed")
        if distributed is not None and distributed.launched_by_torchrun():
            gc.collect()


@contextlib.contextmanager
def _notes_on_one_line() -> Iterator[None]:
    """A setting given under its old name is noted as ``adloco: NOTE`` on one line (by rank 0 alone under
    torchrun: every rank reads the same config), not as a warning's file, line and source; other warnings as ever."""
    previous = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if not issubclass(category, RenamedSettingWarning):
            previous(message, category, filename, lineno, file, line)
        elif os.environ.get("RANK", "0") == "0":
            print(f"adloco: {_one_line(message)}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _command(args: argparse.Namespace) -> int:
    from adloco.config import load_config
    from adloco.errors import CheckpointError, ConfigError, DataError
    from adloco.run.stopping import Stopped

    try:
        if args.command == "train":
            return _train(args, load_config)
        if args.command == "prepare":
            return _prepare(args)
        if args.command in ("eval", "sample", "plot"):
            return _use_run(args)
        if args.command == "gradients":
            return _gradients(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "lighthouse":
            from adloco.replicas.lighthouse import serve

            return serve(args.host, args.port, args.min_replicas, args.join_timeout, args.heartbeat_timeout)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"adloco: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as error:
        from adloco.comm.distributed import launched_by_torchrun
        from adloco.errors import StorageError
        from adloco.run.training import NonFiniteError

        if isinstance(error, NonFiniteError | StorageError):  # runtime failures: exit code 1
            print(f"adloco: error: {_one_line(error)}", file=sys.stderr)
            return 1

        if not launched_by_torchrun():
            raise
        # A dead or hung peer surfaces as a failed or timed-out collective; say so instead of a traceback.
        line = first_line(error)
        rank = os.environ.get("RANK", "?")
        from adloco.comm.distributed import max_restarts, restart_attempt

        then = (
            "torchrun restarts the job, which resumes from the last checkpoint by itself"
            if restart_attempt() < max_restarts()
            else "the job stops here; resume with --resume RUN_DIR from the last checkpoint"
        )
        print(
            f"adloco: error: rank {rank} lost contact with the other ranks ({line[:200]}); {then}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt as error:
        # Interrupted names the run and its newest checkpoint; a bare one came before the run directory existed.
        print(f"adloco: {_one_line(error or 'interrupted before the run started')}", file=sys.stderr)
        return 130
    except Stopped as error:
        if os.environ.get("RANK", "0") == "0":  # every rank stops at the same boundary; rank 0 speaks for the job
            print(f"adloco: {_one_line(error)}", file=sys.stderr)
        return error.exit_code
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from adloco.data.prepare import PrepareSettings, prepare, summary

    suffixes = tuple(s.strip() for s in args.suffixes.split(",") if s.strip())
    settings = PrepareSettings(
        args.source, args.tokenizer, args.vocab_size, args.bpe_chars, args.bpe_every, args.shard_tokens,
        args.val_documents, args.val_every, args.val_fraction, args.text_field, args.hf_config, args.hf_data_files,
        args.split, suffixes, args.processes,
    )  # fmt: skip
    console = Console(stderr=True, quiet=args.quiet)
    try:
        manifest = prepare(settings, Path(args.out), console)
    except KeyboardInterrupt:
        print("adloco: prepare interrupted; the same command resumes it", file=sys.stderr)
        return 130
    except RuntimeError as error:  # a tokenizing process died (out of memory, killed): not the input's fault
        print(f"adloco: error: prepare stopped: {_one_line(first_line(error))}; the same command resumes it",
              file=sys.stderr)  # fmt: skip
        return 1
    print(summary(manifest, Path(args.out)))
    return 0


def _runs(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from adloco.run.runs import find_runs, runs_table

    root = Path(args.root)
    runs = find_runs(root)
    if args.json:
        for run in runs:
            print(json.dumps(run.to_json()))
    elif runs:
        console = Console()
        # piped output has no width to fit: print whole rows instead of rich's default 80 columns
        Console(width=max(console.width, 200) if not console.is_terminal else None).print(runs_table(runs, root))
    else:
        print(f"no runs under {root}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import json

    from adloco.data import DataError
    from adloco.tools.estimate import estimate, format_estimate, unreachable_message

    result = estimate(Path(args.run_dir), args.target, args.calibrate_rounds, args.trainer)
    if not result["prediction"]["reachable"]:  # a question without an answer, like any other bad input
        raise DataError(unreachable_message(result))
    print(json.dumps(result) if args.json else format_estimate(result))
    return 0


def _use_run(args: argparse.Namespace) -> int:
    from adloco.errors import CheckpointError

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():  # before torch is imported: a typo is answered at once
        raise CheckpointError(f"run directory '{run_dir}' does not exist")
    from adloco.tools.inference import evaluate_final, sample_stream

    if args.command == "plot":
        from adloco.metrics.plots import plot_run

        for path in plot_run(run_dir):
            print(path)
        return 0
    if args.command == "eval":
        result = evaluate_final(run_dir)
        loss, count = result.loss, result.count
        if result.accuracy is None:
            print(f"validation loss {loss:.4f} (perplexity {math.exp(loss):.3f}) over {count:,} tokens")
        else:
            print(f"validation loss {loss:.4f}, accuracy {result.accuracy:.4f} over {count:,} samples")
    else:
        for piece in sample_stream(run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed):
            print(piece, end="", flush=True)
        print()
    return 0


def _gradients(args: argparse.Namespace) -> int:
    from rich.console import Console

    from adloco.tools.gradients import analyze, parse_batch_sizes, parse_checkpoint, print_report

    report = analyze(
        Path(args.run_dir),
        checkpoint=parse_checkpoint(args.checkpoint),
        trainer=args.trainer,
        samples=args.samples,
        batch_sizes=parse_batch_sizes(args.batch_sizes, args.samples),
        repeats=args.repeats,
        seed=args.seed,
        out_dir=Path(args.out) if args.out else None,
        threads=args.threads,
    )
    print_report(report, Console())
    return 0


@contextlib.contextmanager
def _verbose_log(console):
    """train.log's lines on the console as well, drawn by rich so that they do not tear the progress bar."""
    import logging

    from rich.logging import RichHandler

    handler = RichHandler(console=console, show_time=False, show_path=False, markup=False)
    logger = logging.getLogger("adloco")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _train(args: argparse.Namespace, load_config) -> int:
    from rich.console import Console

    from adloco.config import ConfigError
    from adloco.config.input import reject_repeated

    config_file, overrides = _split_items(args.items)
    if config_file is not None:
        _check_config_file(config_file, args.items[1:])
    reject_repeated(overrides)
    if args.resume is not None:  # --resume "" is an error, not a fresh default run
        if not args.resume.strip():
            raise ConfigError("--resume needs a run directory, got an empty path")
        if config_file:
            raise ConfigError(
                f"--resume continues a run with its own config; give overrides (key=value), not '{config_file}'"
            )
        from adloco.config import resume_config

        run_dir = Path(args.resume)
        config = resume_config(run_dir, overrides)
    else:
        run_dir = None
        config = load_config(config_file, overrides)  # before the heavy imports: a typo fails in a second or two
    if args.print_config == "all":
        print(config.to_yaml(), end="")
        return 0
    if args.print_config == "basic":
        import yaml

        from adloco.config import basic_settings, count_settings

        basic, total = count_settings()
        print(yaml.safe_dump(basic_settings(config), sort_keys=False), end="")
        print(f"# {basic} basic settings of {total} shown; --print-config=all prints every one")
        return 0
    if args.quiet:
        config.run.progress = False
    from adloco.config import WorldSpec
    from adloco.run.preflight import check_inputs

    world: WorldSpec | None = config.world
    root: str | None = config.run.root
    if config.fault_tolerance.lighthouse is not None:  # a replica's world and run directory are its own
        world, root = None, None
    # before torch is imported: a wrong path or world is said in a second
    check_inputs(config.task, config.model, config.data, run_dir, world=world, run_root=root)
    console = Console(stderr=True)
    if config.fault_tolerance.lighthouse is not None:
        return _train_replica(config, run_dir, console, args.verbose)
    from adloco.run.training import train

    with _verbose_log(console) if args.verbose else contextlib.nullcontext():
        result = train(config, resume=run_dir, console=console)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun rank 0 speaks for the job
    print(f"run directory: {result.run_dir}")
    # Perplexity means something for a language model only; a classifier reports its accuracy instead.
    quality = f"perplexity {result.perplexity:.3f}" if result.accuracy is None else f"accuracy {result.accuracy:.4f}"
    print(
        f"final validation loss {result.val_loss:.4f} ({quality}) "
        f"after {result.tokens:,} tokens, {result.rounds} rounds, {result.seconds:.1f} s"
    )
    return 0


def _train_replica(config: TrainConfig, resume: Path | None, console: Console, verbose: bool) -> int:
    """``adloco train`` as one fault-tolerant replica of a job (fault_tolerance.lighthouse given)."""
    import torch

    from adloco.comm.distributed import launched_by_torchrun
    from adloco.replicas.training import check_replica_run, train_replica
    from adloco.run.training import tokenizer_and_task

    check_replica_run(resume, launched_by_torchrun(), shards=config.shards, trainers=config.trainers,
                      elastic=config.elastic)  # fmt: skip
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer, task = tokenizer_and_task(config, None)
    try:
        with _verbose_log(console) if verbose else contextlib.nullcontext():
            result = train_replica(config, task, tokenizer, console)
    except (RuntimeError, TimeoutError) as error:
        from adloco.errors import StorageError
        from adloco.run.training import NonFiniteError

        if isinstance(error, NonFiniteError | StorageError):
            raise
        # torchft's failures (no Lighthouse, no quorum in time, a lost exchange) are the job's, not a bug here
        line = first_line(error)
        if os.environ.get("RANK", "0") != "0":
            return 1  # a sharded worker's first rank speaks for its replica
        print(f"adloco: error: replica {config.fault_tolerance.replica} stopped ({_one_line(line)[:300]}); "
              "the same command starts it again and it heals from its peers", file=sys.stderr)  # fmt: skip
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0  # a sharded worker's first rank speaks for its replica
    print(f"run directory: {result['run_dir']}")
    print(
        f"replica {config.fault_tolerance.replica}: final validation loss {result['val_loss']:.4f} "
        f"after {result['tokens']:,} tokens, {result['rounds']} rounds, {result['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
