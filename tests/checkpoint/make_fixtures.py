"""Write tests/checkpoint/fixtures/v1/: checkpoints in format version 1, as adloco wrote them before version 2, with
what continuing each of them to its end gives (the reference a resume with today's code must meet bit for bit).

Run it with the adloco of commit 267bd5b (the last to write version 1) on the path:

    git worktree add /tmp/adloco-v1 267bd5b
    PYTHONPATH=/tmp/adloco-v1/src python tests/checkpoint/make_fixtures.py

It uses only what that adloco and today's both offer: the command line, ``adloco.DiLoCo`` and
``adloco.checkpoint``'s ``save_checkpoint`` and ``drop_checkpoints_after``.

- ``train-file/``, ``train-sharded/``: an ``adloco train`` run (method=adloco, two trainers that merge, a micro
  LLaMA), cut back to its checkpoint of round 1 as a crash would leave it; ``reference.pt`` beside each holds every
  trainer's θ and the counters of its last checkpoint when resumed to the end (the same as the uninterrupted run's,
  which is checked here).
- ``loop-adloco.pt``, ``loop-int8-eager.pt``: a user's loop mid-round (``adloco.DiLoCo(...).state_dict()`` with the
  model, inner optimizer and sampler), its data and the θ and parameters after the steps that follow.
- ``replica/``: the checkpoint file a replica of ``adloco train`` writes (``save_checkpoint`` of DiLoCo's state, the
  model's and the inner optimizer's), around the int8-eager loop's state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).with_name("fixtures") / "v1"
# The run's config names its model by an absolute path, which a resume may not change: the tests put the stored
# config.json back at this same path before they resume.
MODEL_DIR = Path("/tmp/adloco-checkpoint-fixtures/micro-llama")
TRAIN = [
    "model.context=16",
    "model.preset=null",
    f"model.path={MODEL_DIR / 'config.json'}",
    "method=adloco",
    "trainers=2",
    "workers=1",
    "merge.every=2",
    "batch.size=2",
    "sync_every=4",
    "total_tokens=1536",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "threads=1",
    "checkpoint.every=1",
    "checkpoint.keep=10",
    "run.progress=false",
    "run.plots=false",
    "run.trackers=[]",
    # the time-aware controller's costs pinned: its decisions follow the statistics alone and reproduce exactly
    "batch.step_seconds=[0.01,0.001]",
    "batch.round_seconds=0.05",
    "batch.min_steps_left=1",
]
RESUME_ROUND = 1  # the checkpoint kept: two trainers, which merge after round 2 of the resumed run


def write_micro_llama(folder: Path) -> None:
    """A LLaMA config of a few thousand parameters (tests/test_fuzz.py's ``_micro_llama``)."""
    from transformers import LlamaConfig

    shape = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256}
    LlamaConfig(hidden_size=16, intermediate_size=32, max_position_embeddings=16, **shape).save_pretrained(folder)


def model_config_in_place(fixture: Path) -> None:
    """The run's model config at the absolute path its checkpoint names (written atomically: test runs may meet)."""
    wanted = (fixture / "micro-llama.json").read_bytes()
    target = MODEL_DIR / "config.json"
    if target.exists() and target.read_bytes() == wanted:
        return
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    partial = MODEL_DIR / f".config.json.{os.getpid()}"
    partial.write_bytes(wanted)
    os.replace(partial, target)


def adloco(*args: str) -> None:
    """``python -m adloco ARGS`` with this process's adloco (its PYTHONPATH)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "adloco", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"adloco {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def last_checkpoint(run_dir: Path) -> dict[str, Any]:
    """Every trainer's θ and b and the counters of a run's newest checkpoint."""
    from adloco.checkpoint import latest_checkpoint

    state = latest_checkpoint(run_dir / "checkpoints")
    assert state is not None
    trainers = state["cluster"]["trainers"]
    return {
        "round": state["round"],
        "counters": {k: state["counters"][k] for k in ("round", "tokens", "step", "bytes")},
        "theta": {int(k): [t.clone() for t in trainer["theta"]] for k, trainer in trainers.items()},
        "batch_size": {int(k): int(trainer["batch_size"]) for k, trainer in trainers.items()},
    }


def train_fixture(scratch: Path, name: str, checkpoint_format: str) -> None:
    """A run, cut back to its checkpoint of round ``RESUME_ROUND``, and the reference of resuming it."""
    from adloco.checkpoint import drop_checkpoints_after

    root = scratch / name
    adloco("train", *TRAIN, f"checkpoint.format={checkpoint_format}", f"run.root={root}", "run.name=run")
    whole = last_checkpoint(root / "run")
    cut = root / "cut"
    shutil.copytree(root / "run", cut, ignore=shutil.ignore_patterns("final", "*.lock", "train.log"))
    drop_checkpoints_after(cut / "checkpoints", RESUME_ROUND)
    resumed = root / "resumed"
    shutil.copytree(cut, resumed)
    adloco("train", "--resume", str(resumed))
    reference = last_checkpoint(resumed)
    same = all(
        torch.equal(a, b) for k in whole["theta"] for a, b in zip(whole["theta"][k], reference["theta"][k], strict=True)
    )
    if not same or whole["counters"] != reference["counters"] or whole["theta"].keys() != reference["theta"].keys():
        raise SystemExit(f"{name}: the resumed run does not end on the uninterrupted run's bits")
    target = FIXTURES / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(cut, target / "run")
    shutil.copy(MODEL_DIR / "config.json", target / "micro-llama.json")
    torch.save(reference, target / "reference.pt")


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())


LOOPS: dict[str, dict[str, Any]] = {
    # AdLoCo's adaptive batch with its costs pinned (tests/api/test_adaptive.py's PINNED): the batch's state
    "loop-adloco": {
        "sync_every": 3,
        "method": "adloco",
        "batch": {"size": 1, "b_cap": 16, "step_seconds": [0.01, 0.001], "round_seconds": 0.05, "min_steps_left": 1},
    },
    # a worker's own outer state: int8 error feedback and the eager copy
    "loop-int8-eager": {
        "sync_every": 4,
        "codec": {"name": "int8", "error_feedback": True},
        "outer": {"overlap": "eager"},
    },
}
LOOP_STEPS = (10, 10)  # steps before the state is saved (mid-round for both), steps after


def build_loop(settings: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The loop's model, inner optimizer and ``adloco.DiLoCo`` (the state loaded into them is the test's)."""
    from adloco import DiLoCo

    model = _small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, DiLoCo(model, optimizer, **settings)


def run_loop(model, optimizer, diloco, data: torch.Tensor, batches: Any, start: int, steps: int) -> None:
    """Inner steps ``start`` to ``start + steps``: the adaptive batch's samples from ``batches`` (its sampler), or
    eight rows of ``data`` per step."""
    for step in range(start, start + steps):
        optimizer.zero_grad()
        if batches is not None:
            diloco.batch.backward(lambda x: _loss(model, x), data[next(batches)])
        else:
            _loss(model, data[8 * step : 8 * step + 8]).backward()
        optimizer.step()


def loop_fixture(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A user's loop saved mid-round and what the steps after give."""
    data = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
    model, optimizer, diloco = build_loop(settings)
    sampler = diloco.batch.sampler(len(data), seed=1) if settings.get("method") == "adloco" else None
    batches = iter(sampler) if sampler is not None else None
    with diloco:
        run_loop(model, optimizer, diloco, data, batches, 0, LOOP_STEPS[0])
        saved = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "diloco": diloco.state_dict(),
            **({"sampler": sampler.state_dict()} if sampler is not None else {}),
        }
        saved = torch.load(_bytes(saved), weights_only=True)  # copies, as on disk
        run_loop(model, optimizer, diloco, data, batches, LOOP_STEPS[0], LOOP_STEPS[1])
    diloco.flush()
    fixture = {
        "settings": settings,
        "data": data,
        "steps": list(LOOP_STEPS),
        "state": saved,
        "theta": [t.clone() for t in diloco.theta],
        "params": [p.detach().clone() for p in model.parameters()],
    }
    torch.save(fixture, FIXTURES / f"{name}.pt")
    return fixture


def resume_loop(fixture: dict, state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fixture's loop built afresh, ``state`` (its saved model, inner optimizer, DiLoCo) loaded, the remaining
    steps run: its θ and model parameters."""
    model, optimizer, diloco = build_loop(fixture["settings"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    diloco.load_state_dict(state["diloco"])
    batches = None
    if "sampler" in fixture["state"]:
        sampler = diloco.batch.sampler(len(fixture["data"]), seed=1)
        sampler.load_state_dict(fixture["state"]["sampler"])
        batches = iter(sampler)
    before, after = fixture["steps"]
    assert diloco.inner_step == before and diloco.round_step != 0  # saved mid-round
    with diloco:
        run_loop(model, optimizer, diloco, fixture["data"], batches, before, after)
    diloco.flush()
    ended = [t.clone() for t in diloco.theta], [p.detach().clone() for p in model.parameters()]
    diloco.finish()  # a loop's proper end (a DiLoCo left unfinished warns), after the numbers compared are taken
    return ended


def replica_fixture(loop: dict[str, Any]) -> None:
    """The loop's saved state in the file a replica of adloco train writes at the end of a round."""
    from adloco.checkpoint import save_checkpoint

    target = FIXTURES / "replica"
    shutil.rmtree(target, ignore_errors=True)
    state = loop["state"]
    rounds = LOOP_STEPS[0] // loop["settings"]["sync_every"]
    save_checkpoint(target, rounds, {k: state[k] for k in ("diloco", "model", "optimizer")}, keep=2)


def _bytes(obj: Any) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def main() -> None:
    import adloco
    from adloco.checkpoint import FORMAT_VERSION

    print(f"adloco from {Path(adloco.__file__).parent}")
    if FORMAT_VERSION != 1:  # the fixtures are what version 1 wrote: only its adloco can write them
        raise SystemExit(f"this adloco writes format version {FORMAT_VERSION}; run with 267bd5b's (see the docstring)")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    write_micro_llama(MODEL_DIR)
    with tempfile.TemporaryDirectory() as scratch:
        train_fixture(Path(scratch), "train-file", "file")
        train_fixture(Path(scratch), "train-sharded", "sharded")
    loops = {name: loop_fixture(name, settings) for name, settings in LOOPS.items()}
    replica_fixture(loops["loop-int8-eager"])
    sizes = {str(p.relative_to(FIXTURES)): p.stat().st_size for p in sorted(FIXTURES.rglob("*")) if p.is_file()}
    print(json.dumps(sizes, indent=1))
    print(f"total {sum(sizes.values()):,} bytes")


if __name__ == "__main__":
    main()
