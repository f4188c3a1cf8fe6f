"""Reliability benchmark: fuzzed bad input (clean one-line errors vs tracebacks) and kill -9 trials.

    python benchmarks/reliability.py                          # >= 1000 fuzz inputs + 20 kill -9 trials
    python benchmarks/reliability.py --inputs 200 --trials 3  # a quicker look

(a) A seeded random generator builds inputs in four families: config overrides and YAML files, command lines
(bad overrides, missing or broken run directories, bad numbers for sample), data files and damaged or foreign
checkpoints. Each goes through the real CLI in-process (configs also through ``build_config``); a sample of
them also through ``python -m adloco`` in a subprocess. An outcome is *valid* (accepted; inputs that would
start real training are counted valid without running them), a *clean error* (exit code 2 and one line on
stderr) or a *traceback* (any other exception, several lines, or another exit code). The target is zero
tracebacks.

(b) Kill -9 trials: a small real training run in a subprocess is SIGKILLed at a random moment after its first
checkpoint, resumed with ``adloco train --resume``, and its final parameters are compared bit for bit with an
uninterrupted run. ``kill_9_trial`` is shared with tests/checkpoint/test_files.py.

Prints a table and writes ``benchmarks/results/reliability.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the tests' input builders live in tests/
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from adloco.checkpoint import list_checkpoints  # noqa: E402
from adloco.config.input import layered  # noqa: E402

# Overrides of the kill -9 trials: tiny LLaMA at context 16, a checkpoint every round, one thread.
KILL_RUN = [
    "model.context=16",
    "workers=2",
    "batch.size=2",
    "sync_every=4",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "run.progress=false",
    "run.plots=false",
    "total_tokens=6144",
    "checkpoint.every=1",
    "checkpoint.keep=2",
    "threads=1",
]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def kill_9_trial(
    root: Path, overrides: list[str], name: str, delay: float, reference: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Start ``adloco train`` in a subprocess, SIGKILL it ``delay`` s after its first checkpoint, resume it with
    ``--resume`` and compare its final parameters with ``reference`` bit for bit."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "adloco", "train", *layered(overrides, [f"run.root={root}", f"run.name={name}"])]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = root / name / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list_checkpoints(checkpoints) and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    killed = proc.wait(timeout=60) == -signal.SIGKILL
    killed_at = [p.name for p in list_checkpoints(checkpoints)]
    resumed = subprocess.run(
        [sys.executable, "-m", "adloco", "train", "--resume", str(root / name)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    identical = False
    if resumed.returncode == 0:
        got = final_params(root / name)
        identical = reference.keys() == got.keys() and all(torch.equal(reference[k], got[k]) for k in reference)
    return {
        "trial": name,
        "delay_s": round(delay, 3),
        "killed": killed,
        "checkpoints_at_kill": killed_at,
        "resume_exit_code": resumed.returncode,
        "resume_stderr_tail": resumed.stderr.strip()[-300:] if resumed.returncode else "",
        "bit_identical": identical,
        "seconds": round(time.monotonic() - started, 1),
    }


# -- fuzzing ----------------------------------------------------------------------------------------------------


def _classify(call) -> tuple[str, str]:
    """Run ``call`` (returns an exit code or raises) capturing stderr: ("valid"|"clean"|"traceback", detail)."""
    err = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            code = call()
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:  # exactly what the benchmark counts
            return "traceback", f"{type(error).__name__}: {str(error)[:200]}"
    text = err.getvalue().strip()
    if code in (0, None):
        return "valid", ""
    if code == 2 and text.startswith("adloco: error: ") and "\n" not in text:
        return "clean", text[:200]
    return "traceback", f"exit {code}: {text[-300:]}"


class Fuzzer:
    """Seeded generators of bad input; each ``case_*`` returns (family, description, call)."""

    def __init__(self, seed: int, work: Path) -> None:
        from adloco.config import build_config
        from adloco.run.training import train
        from tests.test_fuzz import KEYS, NASTY, RUN, _garbage_dirs, _micro_llama

        self.rng = random.Random(seed)
        self.work = work
        self.keys, self.nasty = KEYS, NASTY
        model = _micro_llama(work / "micro-llama")
        quiet = io.StringIO()
        with contextlib.redirect_stderr(quiet), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            overrides = [*RUN, "model.preset=null", f"model.path={model}", f"run.root={work}", "run.name=good"]
            self.good = train(build_config(overrides=overrides)).run_dir
        self.broken = _garbage_dirs(work / "broken", self.good)
        self.checkpoint = list_checkpoints(self.good / "checkpoints")[-1].read_bytes()
        self.counter = 0

    def _value(self) -> str:
        rng = self.rng
        pick = rng.random()
        if pick < 0.5:
            return rng.choice(self.nasty)
        if pick < 0.7:
            return str(rng.choice([-1, 0, 1, 2, 10 ** rng.randint(1, 40), -(10 ** rng.randint(1, 40))]))
        alphabet = "abc.=-_/ \t\n:[]{}!&*é日\x00\udcff"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))

    def _key(self) -> str:
        rng = self.rng
        return rng.choice(self.keys) if rng.random() < 0.8 else rng.choice(["foo", "a.b", "model.x", "run", ".", ""])

    def _overrides(self) -> list[str]:
        return [f"{self._key()}={self._value()}" for _ in range(self.rng.randint(1, 4))]

    def _path(self, name: str) -> Path:
        self.counter += 1
        return self.work / "inputs" / f"{self.counter:05d}-{name}"

    def case_config(self):
        from adloco.cli import main
        from adloco.config import ConfigError, build_config, load_config

        rng = self.rng
        kind = rng.choice(["overrides", "yaml", "cli"])
        if kind == "overrides":
            items = self._overrides()

            def call():
                try:
                    build_config(overrides=items)
                except ConfigError as error:
                    print(f"adloco: error: {error}", file=sys.stderr)
                    return 2
                return 0

            return "config", f"overrides {items!r}", call
        if kind == "yaml":
            path = self._path("config.yaml")
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = [f"{self._key().split('.')[-1]}: {self._value()}" for _ in range(rng.randint(0, 4))]
            raw = "\n".join(lines).encode("utf-8", "surrogateescape")
            path.write_bytes(raw if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(64)))

            def call():
                try:
                    load_config(path)
                except ConfigError as error:
                    print(f"adloco: error: {error}", file=sys.stderr)
                    return 2
                return 0

            return "config", f"yaml file {raw[:60]!r}", call
        items = [*self._overrides(), f"run.root={self.work / 'never'}"]
        try:
            load_config(None, items)
        except ConfigError:
            return "cli", f"train {items!r}", lambda: main(["train", *items])
        return "cli", f"train {items!r} (valid config, not run)", lambda: 0

    def case_cli(self):
        from adloco.cli import main

        rng = self.rng
        kind = rng.choice(["broken-dir", "missing-dir", "sample-numbers", "random"])
        if kind == "broken-dir":
            from tests.test_fuzz import BROKEN, _argv

            name = rng.choice(sorted(BROKEN))
            argv = _argv(rng.choice(BROKEN[name]), str(self.broken[name]))
        elif kind == "missing-dir":
            argv = [rng.choice(["eval", "sample", "plot"]), str(self.work / "missing" / self._value())]
            if rng.random() < 0.3:
                argv = ["train", "--resume", argv[1]]
        elif kind == "sample-numbers":
            bad = {
                "--tokens": ["-1", "abc", "1.5", "", "nan", "1000000000000"],
                "--temperature": ["-1", "nan", "-inf", "inf", "x"],
                "--top-k": ["0", "-3", "x"],
                "--seed": ["99999999999999999999999", "x"],
                "--bogus": ["1"],
            }
            flag = rng.choice(sorted(bad))
            argv = ["sample", str(self.good), "--tokens", "2", flag, rng.choice(bad[flag])]
        else:
            words = ["train", "eval", "sample", "plot", "--resume", "--tokens", "--bogus", "-x", "--top-k"]
            argv = [rng.choice(words) if rng.random() < 0.6 else self._value() for _ in range(rng.randint(0, 4))]
            if argv and argv[0] == "train" and "--resume" not in argv:
                argv.append("no_such_key=1")  # never start real training
            if any(
                a.startswith("--") and len(a) > 2 and ("--help".startswith(a) or "--version".startswith(a))
                for a in argv
            ):
                argv = ["--bogus"]
            if any(a in ("-h",) for a in argv) or (argv and argv[0] in ("runs", "gradients", "estimate")):
                argv = ["--bogus"]
        return "cli", repr(argv)[:120], lambda: main(argv)

    def case_classes(self):
        """The classes of mistake a new user's audit found: empty values, repeated keys, YAML aliases (bombs and
        self-references), and shard/rank arithmetic against a torchrun world."""
        from adloco.cli import main
        from adloco.cluster.placement import check_world
        from adloco.config import ConfigError, build_config, load_config

        rng = self.rng
        kind = rng.choice(["empty", "repeated", "aliases", "arithmetic"])
        never = f"run.root={self.work / 'never'}"
        if kind == "empty":
            items = [*self._overrides()[:2], f"{self._key()}=" + rng.choice(["", " ", "\t"])]
            return "classes", f"empty {items!r}", lambda: main(["train", *items, never])
        if kind == "repeated":
            key = self._key()
            items = [f"{key}={self._value()}", *self._overrides()[:2], f"{key}={self._value()}"]
            return "classes", f"repeated {items!r}", lambda: main(["train", *items, never, "no_such_key=1"])
        if kind == "aliases":
            depth, width = rng.randint(1, 12), rng.randint(1, 12)
            lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
            lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
            tail = rng.choice([f"data: {{separator: *a{depth - 1}}}", "self: &s [*s]", f"workers: *a{depth - 1}"])
            path = self._path("aliases.yaml")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join([*lines, tail]) + "\n")

            def call():
                try:
                    load_config(path)
                except ConfigError as error:
                    print(f"adloco: error: {error}"[:400], file=sys.stderr)
                    return 2
                return 0

            return "classes", f"aliases depth {depth} width {width}, {tail}", call
        overrides = [
            f"workers={rng.randint(1, 9)}",
            f"shards={rng.randint(1, 4)}",
            f"elastic={rng.choice(['true', 'false'])}",
        ]
        overrides += [f"slots_per_rank={rng.randint(1, 4)}"] if rng.random() < 0.3 else []
        world, torchrun = rng.randint(1, 12), rng.random() < 0.8

        def arithmetic():
            try:
                config = build_config(overrides=overrides)
                check_world(config.world, world if torchrun else 1, torchrun)
            except ConfigError as error:
                print(f"adloco: error: {error}", file=sys.stderr)
                return 2
            return 0

        return "classes", f"{overrides!r} on {world if torchrun else 1} rank(s)", arithmetic

    def case_data(self):
        from adloco.cli import main

        rng = self.rng
        path = self._path("data.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        kind = rng.choice(["empty", "binary", "not-utf8", "short", "missing", "folder"])
        if kind == "binary":
            path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(1, 150))) + b"\x00")
        elif kind == "not-utf8":
            path.write_bytes(b"text " * rng.randint(0, 20) + b"\xff\xc0" + b" more" * rng.randint(0, 5))
        elif kind == "short":
            path.write_text("".join(rng.choice("abc é\n") for _ in range(rng.randint(1, 12))), encoding="utf-8")
        elif kind == "empty":
            path.write_bytes(b"")
        elif kind == "folder":
            path.mkdir()
        argv = ["train", "model.context=16", "run.trackers=[]", f"data.dataset={path}", f"run.root={self.work}/never"]
        return "data", kind, lambda: main(argv)

    def case_checkpoint(self):
        from adloco.cli import main
        from tests.test_fuzz import _resume_copy, _torch_bytes

        rng = self.rng
        data = bytearray(self.checkpoint)
        kind = rng.choice(["truncated", "flipped", "random", "foreign", "version"])
        with_manifest = kind == "flipped" or rng.random() < 0.5
        if kind == "truncated":
            data = data[: rng.randrange(len(data))]
        elif kind == "flipped":
            for offset in rng.sample(range(len(data)), rng.randint(1, 4)):
                data[offset] ^= rng.randint(1, 255)
        elif kind == "random":
            data = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        elif kind == "foreign":
            data = bytearray(_torch_bytes({"format_version": 1, rng.choice(["x", "round", "cluster"]): rng.random()}))
        else:
            data = bytearray(_torch_bytes({"format_version": rng.choice([0, 2, 99, "1", None])}))
        run_dir = _resume_copy(self.good, self._path("run"), bytes(data), with_manifest)
        return (
            "checkpoint",
            f"{kind}{' +manifest' if with_manifest else ''}",
            lambda: main(["train", "--resume", str(run_dir)]),
        )


def fuzz(inputs: int, seed: int, subprocess_sample: int, work: Path) -> dict[str, Any]:
    fuzzer = Fuzzer(seed, work)
    families = [fuzzer.case_config, fuzzer.case_cli, fuzzer.case_classes, fuzzer.case_data, fuzzer.case_checkpoint]
    counts: dict[str, dict[str, int]] = {}
    tracebacks: list[dict[str, str]] = []
    cases = []
    seconds: dict[str, float] = {}
    for index in range(inputs):
        started = time.perf_counter()
        family, description, call = families[index % len(families)]()
        outcome, detail = _classify(call)
        seconds[family] = seconds.get(family, 0.0) + time.perf_counter() - started
        counts.setdefault(family, {"valid": 0, "clean": 0, "traceback": 0})[outcome] += 1
        cases.append((family, description))
        if outcome == "traceback":
            tracebacks.append({"family": family, "input": description, "detail": detail})
    # A sample through real subprocesses: what a user at a shell sees.
    sub = {"valid": 0, "clean": 0, "traceback": 0}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    commands = [
        ["eval", str(work / "missing")],
        ["sample", str(fuzzer.good), "--temperature", "nan"],
        ["sample", str(fuzzer.good), "--top-k", "0"],
        ["train", "inner.lr=.inf"],
        ["train", "seed=99999999999999999999"],
        ["train", "run.name=../x"],
        ["train", "--resume", ""],
        ["plot", str(fuzzer.broken["metrics-a-folder"])],
        ["eval", str(fuzzer.broken["final-weights-truncated"])],
        ["train", "--resume", str(fuzzer.broken["manifest-garbage"])],
        ["train", "model.preset=x", "--bogus"],
        ["train", f"data.dataset={work / 'missing.txt'}"],
        # What a user tried when running adloco as a cluster job:
        ["train", "inner.lr=1e300"],
        ["train", "inner.lr=1e40"],
        ["sample", str(fuzzer.good), "--tokens", "1000000000000"],
        ["train", "--resume", str(fuzzer.good), "workers=1"],
        ["train", "workers=100000", "model.preset=small", f"run.root={work / 'never'}"],
        # What a new user's audit tried:
        ["train", "workers="],
        ["train", "workers=2", "workers=3"],
        ["train", "shards=2", f"run.root={work / 'never'}"],
        ["train", "workers", "4"],
        ["train", "run.name=good", f"run.root={work}"],
        ["plot", str(fuzzer.broken["metrics-binary"])],
    ]
    for index in range(subprocess_sample):
        if index < len(commands):
            argv = commands[index]
        else:  # an exec'd argument cannot hold NUL or lone surrogates
            items = [*fuzzer._overrides(), "no_key=1"]
            argv = ["train", *("".join(c for c in i if c != "\x00" and not 0xD800 <= ord(c) < 0xE000) for i in items)]
        result = subprocess.run(
            [sys.executable, "-m", "adloco", *argv], capture_output=True, text=True, env=env, cwd=work, timeout=300
        )
        text = result.stderr.strip()
        if result.returncode == 2 and text.startswith("adloco: error: ") and "\n" not in text:
            sub["clean"] += 1
        else:
            sub["traceback"] += 1
            tracebacks.append({"family": "subprocess", "input": repr(argv), "detail": text[-300:]})
    print("  seconds per family: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), flush=True)
    return {"inputs": inputs, "by_family": counts, "subprocess": sub, "tracebacks": tracebacks, "seconds": seconds}


def kill_trials(trials: int, seed: int, work: Path, checkpoint_format: str = "file") -> list[dict[str, Any]]:
    from adloco.config import build_config
    from adloco.run.training import train

    run = [*KILL_RUN, f"checkpoint.format={checkpoint_format}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = final_params(train(build_config(overrides=[*run, f"run.root={work}", "run.name=ref"])).run_dir)
    rng = random.Random(seed)
    results = []
    for trial in range(trials):
        result = kill_9_trial(work, run, f"killed{trial:02d}", rng.uniform(0.0, 1.5), reference)
        print(
            f"  trial {trial + 1:2d}: killed {result['killed']}, after {result['checkpoints_at_kill'][-1:]}, "
            f"resume exit {result['resume_exit_code']}, bit-identical {result['bit_identical']}",
            flush=True,
        )
        results.append(result)
        shutil.rmtree(work / result["trial"], ignore_errors=True)
    return results


def _markdown(summary: dict[str, Any]) -> str:
    fuzzed, trials = summary["fuzz"], summary["kill_9"]
    lines = [
        f"Measured {summary['date']} with adloco {summary['adloco']}, torch {summary['torch']}, "
        f"Python {summary['python']}, {summary['machine']}; `{summary['command']}`.",
        "",
        "| inputs | valid | clean one-line error | traceback |",
        "| --- | ---: | ---: | ---: |",
    ]
    for family, counts in fuzzed["by_family"].items():
        lines.append(f"| {family} | {counts['valid']} | {counts['clean']} | {counts['traceback']} |")
    sub = fuzzed["subprocess"]
    lines.append(f"| subprocess sample | {sub['valid']} | {sub['clean']} | {sub['traceback']} |")
    total = {k: sum(c[k] for c in fuzzed["by_family"].values()) + sub[k] for k in ("valid", "clean", "traceback")}
    lines.append(f"| **all {sum(total.values())}** | {total['valid']} | {total['clean']} | **{total['traceback']}** |")
    if trials:
        killed = sum(t["killed"] for t in trials)
        identical = sum(t["bit_identical"] for t in trials)
        resumed = sum(t["resume_exit_code"] == 0 for t in trials)
        lines += [
            "",
            "| kill -9 trials | killed mid-run | resumed (exit 0) | bit-identical to the uninterrupted run |",
            "| ---: | ---: | ---: | ---: |",
            f"| {len(trials)} | {killed} | {resumed} | {identical} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=1000, help="fuzzed inputs in-process (default 1000)")
    parser.add_argument("--subprocess", type=int, default=24, help="of which also through subprocesses (default 24)")
    parser.add_argument("--trials", type=int, default=20, help="kill -9 trials (default 20; 0 skips them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-format",
        choices=["file", "sharded"],
        default="file",
        help="checkpoint.format of the kill -9 trials (results of 'sharded' go to reliability-sharded.*)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import adloco

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="adloco-reliability-") as tmp:
        work = Path(tmp)
        print(f"fuzzing {args.inputs} inputs ...", flush=True)
        fuzzed = fuzz(args.inputs, args.seed, args.subprocess, work / "fuzz")
        print(f"kill -9: {args.trials} trials ...", flush=True)
        (work / "kill").mkdir()
        trials = kill_trials(args.trials, args.seed, work / "kill", args.checkpoint_format) if args.trials else []
    summary = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(["python benchmarks/reliability.py", *sys.argv[1:]]),
        "adloco": adloco.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{os.cpu_count()} CPU cores, {platform.system()}",
        "seconds": round(time.monotonic() - started, 1),
        "fuzz": fuzzed,
        "kill_9": trials,
    }
    table = _markdown(summary)
    print(table)
    for item in fuzzed["tracebacks"][:20]:
        print(f"traceback: {item['family']}: {item['input']} -> {item['detail']}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "reliability" if args.checkpoint_format == "file" else "reliability-sharded"
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(table)
    bad_trials = [t for t in trials if not (t["killed"] and t["bit_identical"])]
    return 1 if fuzzed["tracebacks"] or bad_trials else 0


if __name__ == "__main__":
    sys.exit(main())
