"""Run by tests/api/test_diloco.py under torchrun on 4 ranks: 2 DiLoCo workers, each a model sharded with FSDP2
over 2 ranks (examples/sharded_loop.py's loop), against the same 2 workers unsharded; a mid-round
torch.distributed.checkpoint of the sharded run resumed; the refusals of a mesh DiLoCo cannot use; and AdLoCo's
adaptive batch over the same sharded workers, each rank reading its worker's whole batch. Rank 0 writes what it
found to the JSON file named by the first argument."""

import importlib.util
import json
import sys
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from adloco import DiLoCo, end_process_group
from adloco.data.sources import bundled_text

_spec = importlib.util.spec_from_file_location("sharded_loop", Path(__file__).parents[2] / "examples/sharded_loop.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

CONTEXT, BATCH, STEPS, STOP, H = 16, 4, 10, 5, 4  # 3 rounds: 4, 4 and a last one of 2; stopped within round 2
# AdLoCo's batch with pinned costs (decisions that do not hang on this machine's timings), from b = 2
ADAPTIVE = {"size": 2, "b_cap": 16, "time": {"step_seconds": [0.01, 0.001], "round_seconds": 0.05, "min_steps_left": 1}}


def build(mesh=None):
    model = example.build_model(CONTEXT, hidden=32, layers=2)
    if mesh is not None:
        model = example.shard(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def steps(model, optimizer, diloco, batches, part) -> None:
    with diloco:
        for batch in batches:
            mine = part(batch)
            model(input_ids=mine, labels=mine).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()


def refusals(mesh) -> list[str]:
    said = []
    model, optimizer = build(mesh["shard"])
    try:
        DiLoCo(model, optimizer, sync_every=H)  # the whole job: ranks holding different rows would be averaged
    except ValueError as error:
        said.append(str(error))
    model, optimizer = build(mesh)  # HSDP: FSDP itself would average the gradients across workers
    try:
        DiLoCo(model, optimizer, sync_every=H, process_group=mesh["replicate"])
    except ValueError as error:
        said.append(str(error))
    return said


def adloco(mesh, windows, sharded: bool, batch: dict, seed: int) -> dict:
    """AdLoCo over the workers (sharded over ``mesh["shard"]`` or whole on each rank): every rank reads its
    worker's whole batch of the size the adaptive batch asks for and runs its backward; θ whole, b of each step,
    and the step cost each decision weighed."""
    model, optimizer = build(mesh["shard"] if sharded else None)
    diloco = DiLoCo(model, optimizer, sync_every=H, method="adloco", batch=batch, process_group=mesh["replicate"])
    loss_of = lambda ids: model(input_ids=ids, labels=ids).loss  # noqa: E731
    sizes, timed = [], []
    with diloco:
        for _, indices in zip(range(STEPS), diloco.batch.sampler(len(windows), seed=seed), strict=False):
            sizes.append(len(indices))
            diloco.batch.backward(loss_of, windows[indices])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if diloco.round_step == 0:
                timed.append((diloco.batch.last_decision or {}).get("timed"))
    diloco.finish()
    theta = [p.full_tensor() if sharded else p.detach() for p in model.parameters()]
    return {"theta": theta, "sizes": sizes, "timed": timed}


def adaptive(mesh, data) -> dict:
    """AdLoCo sharded against the same workers whole; with measured costs, the b every rank of a worker chose; a
    worker's ranks given different samples, refused on both."""
    worker = mesh.get_local_rank("replicate")
    windows = data[: len(data) // CONTEXT * CONTEXT].reshape(-1, CONTEXT)
    sharded, whole = (adloco(mesh, windows, s, ADAPTIVE, seed=worker) for s in (True, False))
    measured = adloco(
        mesh,
        windows,
        True,
        {**ADAPTIVE, "time": {**ADAPTIVE["time"], "step_seconds": None, "round_seconds": None}},
        seed=worker,
    )
    pairs = zip(sharded["theta"], whole["theta"], strict=True)
    refused = ""
    try:
        adloco(mesh, windows, True, ADAPTIVE, seed=mesh.get_rank())  # each rank its own samples
    except ValueError as error:
        refused = str(error)
    return {
        "difference": max(float((a - b).abs().max()) for a, b in pairs),
        "sizes": [sharded["sizes"], whole["sizes"]],
        "measured": [worker, measured["sizes"], measured["timed"]],
        "refused": refused,
    }


def first_decision(mesh, batches, part) -> dict:
    """The H decision at the end of a first round of 2 steps with sync_every="auto" (sharded over ``mesh["shard"]``
    when ``part`` takes this rank's share of the batch)."""
    model, optimizer = build(mesh["shard"] if part is not None else None)
    diloco = DiLoCo(model, optimizer, sync_every="auto", sync_auto={"start": 2, "min": 2, "max": 8},
                    process_group=mesh["replicate"])  # fmt: skip
    example.train(model, optimizer, batches(0, 2), diloco, **({"part": part} if part is not None else {}))
    return diloco.rounds.last.to_dict()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    worker, index = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    data = torch.tensor(list(bundled_text("tinyshakespeare").encode()[:20000]))

    def batches(start=0, stop=STEPS):
        return islice(example.windows(data, BATCH, CONTEXT, seed=worker), start, stop)

    half = lambda batch: batch.chunk(2)[index]  # noqa: E731 - this rank's share of its worker's batch
    whole, optimizer = build()  # the reference: each worker on one rank (both shards' ranks compute it)
    unsharded = DiLoCo(whole, optimizer, sync_every=H, process_group=mesh["replicate"])
    example.train(whole, optimizer, batches(), unsharded)

    model, optimizer = build(mesh["shard"])
    sharded = DiLoCo(model, optimizer, sync_every=H, process_group=mesh["replicate"])
    example.train(model, optimizer, batches(), sharded, part=half)
    theta = [p.full_tensor() for p in model.parameters()]

    model, optimizer = build(mesh["shard"])  # stopped mid-round, checkpointed with DCP, resumed by new objects
    first = DiLoCo(model, optimizer, sync_every=H, process_group=mesh["replicate"])
    steps(model, optimizer, first, batches(0, STOP), half)
    own = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save({f"worker{worker}": own, "diloco": first}, checkpoint_id=out.parent / "dcp")
    model, optimizer = build(mesh["shard"])
    resumed = DiLoCo(model, optimizer, sync_every=H, process_group=mesh["replicate"])
    own = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load({f"worker{worker}": own, "diloco": resumed}, checkpoint_id=out.parent / "dcp")
    set_model_state_dict(model, own["model"])
    set_optimizer_state_dict(model, optimizer, own["optimizer"])
    example.train(model, optimizer, batches(STOP, STEPS), resumed, part=half)
    again = [p.full_tensor() for p in model.parameters()]

    found = {
        "difference": max(float((a - b).detach().abs().max()) for a, b in zip(theta, whole.parameters(), strict=True)),
        "identical": all(torch.equal(a, b) for a, b in zip(theta, whole.parameters(), strict=True)),
        "resumed_identical": all(torch.equal(a, b) for a, b in zip(theta, again, strict=True)),
        "moved": max(float((a - b).detach().abs().max()) for a, b in zip(theta, build()[0].parameters(), strict=True)),
        "rounds": sharded.inner_step // H + 1,
        "bytes": [sharded.comm.stats.wire_bytes, unsharded.comm.stats.wire_bytes],
        "refusals": refusals(mesh),
        # a sharded worker's shards choose one H from the whole worker's dispersion, as the unsharded workers'
        "auto": [first_decision(mesh, batches, half), first_decision(mesh, batches, None)],
        "adaptive": adaptive(mesh, data),
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()
