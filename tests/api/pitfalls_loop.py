"""Two torchrun ranks running a tiny loop the way a new user might, scenario after scenario (issue 53, part 5).

Run by tests/api/test_own_loop_pitfalls.py: ``python -m torch.distributed.run --nproc_per_node=2 ...
pitfalls_loop.py OUT SCENARIO [SCENARIO ...]``. Each rank writes what it saw in each scenario (its error's text, the
warnings, whether the ranks' models agreed) as JSON into ``OUT/<scenario>.rank<r>.json``; an error adloco raised is
a result, not a failure.
"""

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adloco import DiLoCo, end_process_group

H = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    x = torch.randn(8, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        _loss(model, step, rank).backward()
        optimizer.step()
        optimizer.zero_grad()


def _alike(model: torch.nn.Module) -> bool:
    """Whether every rank's model holds the same bits."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def ddp(rank: int, around: bool) -> dict[str, Any]:
    """The model still in DistributedDataParallel: given to DiLoCo in it, or with the wrapper left around it."""
    model = _model()
    wrapper = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model if around else wrapper, optimizer, sync_every=H)
    with diloco:
        _train(wrapper, optimizer, H // 2, rank)  # the loop calls the wrapper, as it did under DDP
        apart = not _alike(model)  # mid-round each worker is its own
        _train(wrapper, optimizer, H // 2, rank)
    diloco.finish()
    return {"apart_mid_round": apart, "alike_at_the_end": _alike(model)}


def uneven(rank: int, steps: list[int], method: str) -> dict[str, Any]:
    """Ranks that take different numbers of optimizer steps (an uneven last batch); ``streaming``: two fragments,
    whose exchanges start mid-round and land a step later (one is in flight when a rank finishes)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings: dict[str, Any] = {"streaming": {"fragments": 2}} if method == "streaming" else {}
    with DiLoCo(model, optimizer, sync_every=H, method=method, **settings) as diloco:
        _train(model, optimizer, steps[rank], rank)
    diloco.finish()
    return {}


def scaler(rank: int, hooked: bool, steps: int) -> dict[str, Any]:
    """torch.amp.GradScaler around DiLoCo, rank 1's loss overflowing at step 1 so that its scaler skips that
    optimizer.step() (and with it the optimizer's hooks): ``hooked``, inside `with diloco:`; else the documented
    recipe, diloco.step() after scaler.step(optimizer) at every iteration."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu")
    diloco = DiLoCo(model, optimizer, sync_every=H, check_finite=False)  # the scaler keeps overflows out

    def train() -> None:
        for step in range(steps):
            loss = _loss(model, step, rank) * (float("inf") if rank == 1 and step == 1 else 1.0)
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            optimizer.zero_grad()
            if not hooked:
                diloco.step()

    if hooked:
        with diloco:
            train()
    else:
        train()
    diloco.finish()
    return {"steps": diloco.inner_step, "scale": grad_scaler.get_scale(), "alike_at_the_end": _alike(model)}


def restore_order(rank: int, folder: Path) -> dict[str, Any]:
    """A run stopped mid-round (6 steps, H = 4) and saved by each rank; restored with the model's state loaded
    before DiLoCo(...) is built (which gives every rank rank 0's parameters), then in the documented order."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diloco = DiLoCo(model, optimizer, sync_every=H)
    with diloco:
        _train(model, optimizer, 6, rank)
    saved = folder / f"state{rank}.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": diloco.state_dict()}, saved)
    with diloco:
        _train(model, optimizer, 2, rank, start=6)
    diloco.finish()
    found: dict[str, Any] = {}
    state = torch.load(saved, weights_only=True)  # loaded anew for each restore: an optimizer takes its tensors
    early = _model()
    early.load_state_dict(state["model"])  # the natural order: the model first, then DiLoCo(...)
    early_optimizer = torch.optim.SGD(early.parameters(), lr=0.1, momentum=0.9)
    early_optimizer.load_state_dict(state["optimizer"])
    try:
        DiLoCo(early, early_optimizer, sync_every=H).load_state_dict(state["diloco"])
    except ValueError as error:
        found["wrong_order"] = str(error)
    state = torch.load(saved, weights_only=True)
    again = _model()
    again_optimizer = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    resumed = DiLoCo(again, again_optimizer, sync_every=H)
    again.load_state_dict(state["model"])
    again_optimizer.load_state_dict(state["optimizer"])
    resumed.load_state_dict(state["diloco"])
    with resumed:
        _train(again, again_optimizer, 2, rank, start=6)
    resumed.finish()
    # as the HF Trainer and Lightning restore: rank 0's model on every rank first, each rank's own after DiLoCo(...)
    state = torch.load(saved, weights_only=True)
    framework = _model()
    framework.load_state_dict(torch.load(folder / "state0.pt", weights_only=True)["model"])
    framework_optimizer = torch.optim.SGD(framework.parameters(), lr=0.1, momentum=0.9)
    restored = DiLoCo(framework, framework_optimizer, sync_every=H)
    framework.load_state_dict(state["model"])
    framework_optimizer.load_state_dict(state["optimizer"])
    restored.load_state_dict(state["diloco"])  # rank 0's model is θ here, the others' are not: no refusal
    with restored:
        _train(framework, framework_optimizer, 2, rank, start=6)
    restored.finish()
    found["framework_identical"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), framework.parameters(), strict=True)
    )
    found["resumed_identical"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    return found


def run(scenario: str, rank: int, out: Path) -> dict[str, Any]:
    """One scenario on this rank: what it saw, its error a result."""
    found: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if scenario == "ddp-given":
                found = ddp(rank, around=False)
            elif scenario == "ddp-around":
                found = ddp(rank, around=True)
            elif scenario == "no-group":
                model = _model()
                DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=H)
            elif scenario.startswith("uneven-"):  # uneven-<rank 0's steps>-<rank 1's>[-<method>]
                parts = scenario.split("-")[1:]
                method = "diloco" if parts[-1].isdigit() else parts.pop()
                found = uneven(rank, [int(n) for n in parts], method)
            elif scenario in ("scaler-recipe", "scaler-hooked"):
                found = scaler(rank, hooked=scenario == "scaler-hooked", steps=10)
            elif scenario == "settings-differ":
                model = _model()
                DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=H * (rank + 1))
            elif scenario == "restore-order":
                found = restore_order(rank, out)
            else:
                raise SystemExit(f"unknown scenario {scenario}")
        except (RuntimeError, ValueError) as error:
            found["error"] = str(error)
    found["warnings"] = [str(w.message) for w in caught]
    if scenario != "no-group":  # after each scenario the group is in step: no collective is left pending
        ones = torch.ones(1)
        dist.all_reduce(ones)
        found["group_after"] = ones.item()
    return found


def main(out: str, scenarios: list[str]) -> None:
    """The scenarios one after another in one process group (one launch: starting torchrun costs more than most
    of them), each rank's findings in ``OUT/<scenario>.rank<r>.json``; ``no-group`` alone, without a group."""
    torch.set_num_threads(1)
    if scenarios != ["no-group"]:
        dist.init_process_group("gloo")
    rank = int(__import__("os").environ["RANK"])
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        print(f"rank {rank}: scenario {scenario}", file=sys.stderr, flush=True)  # a crash's output names it
        found = run(scenario, rank, folder)
        (folder / f"{scenario}.rank{rank}.json").write_text(json.dumps(found))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
