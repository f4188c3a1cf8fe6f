"""What a new user's own loop trips on, each refused or warned about in one line (issue 53, part 5): in one
process where ranks do not matter, on two gloo ranks (tests/api/pitfalls_loop.py) where they do."""

import gc
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from adloco import DiLoCo
from tests.comm.test_distributed import _env, _free_port

SCRIPT = Path(__file__).with_name("pitfalls_loop.py")
# its scenarios share one torchrun launch (in_a_group): under pytest-xdist one test process runs them all
pytestmark = pytest.mark.xdist_group("pitfalls")


# The scenarios that run in a process group, one after another in one launch (starting torchrun costs more than
# most of them); each leaves the group in step for the next, which the fixture checks.
IN_A_GROUP = ["ddp-given", "ddp-around", "settings-differ", "scaler-recipe", "scaler-hooked", "restore-order",
              "uneven-7-6", "uneven-5-4", "uneven-8-7", "uneven-9-4", "uneven-6-5-streaming"]  # fmt: skip


def _launch(folder: Path, scenarios: list[str]) -> dict[str, list[dict]]:
    """What each of two torchrun ranks saw running ``scenarios`` of pitfalls_loop.py, by scenario."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(SCRIPT), str(folder), *scenarios]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, cwd=folder.parent, timeout=300, env=_env())
    except subprocess.TimeoutExpired:
        stuck = next(s for s in scenarios if not list(folder.glob(f"{s}.rank*.json")))
        raise AssertionError(f"the launch hung in scenario {stuck} (or left the group broken for it)") from None
    assert result.returncode == 0, result.stderr[-3000:]
    return {s: [json.loads((folder / f"{s}.rank{r}.json").read_text()) for r in range(2)] for s in scenarios}


@pytest.fixture(scope="module")
def in_a_group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    seen = _launch(tmp_path_factory.mktemp("pitfalls") / "ranks", IN_A_GROUP)
    for scenario, ranks in seen.items():  # a scenario that left a collective half-paired would hang the next
        assert [rank["group_after"] for rank in ranks] == [2.0, 2.0], scenario
    return seen


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_finish_without_a_round_is_refused_instead_of_undoing_the_training():
    """A loop that never entered `with diloco:` nor called diloco.step(): finish() would set the model to the
    untrained θ; it refuses and leaves the trained model alone."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=2)
    _steps(model, optimizer, 4)  # trained, but DiLoCo saw none of it
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"no round ran: enter `with diloco:` or call `diloco.step\(\)`"):
        diloco.finish()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained, strict=True))


@pytest.mark.process
@pytest.mark.parametrize("scenario", ["ddp-given", "ddp-around"])
def test_a_model_still_in_ddp_trains_as_diloco_with_a_line_saying_so(in_a_group, scenario):
    """Given in DistributedDataParallel, or with the wrapper left around it and the loop calling the wrapper: DDP
    would average every step's gradients (the workers one model, another algorithm); DiLoCo turns that off on the
    wrapper and says so, so mid-round the ranks' models differ and at the round's end they are θ."""
    for rank in in_a_group[scenario]:
        assert "error" not in rank, rank["error"]
        assert rank["apart_mid_round"] and rank["alike_at_the_end"]
        said = [w for w in rank["warnings"] if "DistributedDataParallel" in w]
        assert len(said) == 1 and "keeps each rank's own" in said[0]


@pytest.mark.process
def test_torchrun_without_a_process_group_is_refused_on_every_rank(tmp_path):
    """Under torchrun (WORLD_SIZE=2) a loop that never called dist.init_process_group would train each rank alone as
    a one-worker DiLoCo; both ranks refuse."""
    for rank in _launch(tmp_path / "ranks", ["no-group"])["no-group"]:
        assert "the launcher started 2 ranks (WORLD_SIZE) but torch.distributed is not initialised" in rank["error"]


@pytest.mark.process
@pytest.mark.parametrize(("scenario", "counts"), [("uneven-7-6", "rank 0: 7, rank 1: 6"),
                                                  ("uneven-5-4", "rank 0: 5, rank 1: 4"),
                                                  ("uneven-8-7", "rank 0: 8, rank 1: 7"),
                                                  ("uneven-9-4", "rank 0: 8, rank 1: 4"),
                                                  ("uneven-6-5-streaming", "rank 0: 6, rank 1: 5")])  # fmt: skip
def test_ranks_that_took_different_numbers_of_steps_are_refused_on_every_rank(in_a_group, scenario, counts):
    """An uneven last batch: one rank takes a step more. In a round (7 against 6, H = 4) their exchanges carried
    reports of unlike lengths and gloo aborted; with one rank at a round's boundary (5 against 4) the other's last
    exchange met no peer. Where the extra steps end a round the other rank never reaches (8 against 7; 9 against 4,
    a whole round more), rank 0 waits in that round's exchange while rank 1 is in finish(): the two used to meet in
    unlike collectives and hang (or abort in gloo). Streaming (6 against 5, two fragments): rank 0's sixth step
    starts a fragment's exchange that rank 1 never starts, still in flight at finish(), and gloo aborted. Every rank
    now refuses in one line naming the counts (rank 0's as far as it got: the step whose exchange no peer joined),
    and the process group is left in step: a collective after the refusal pairs on both ranks."""
    for rank in in_a_group[scenario]:
        assert f"the ranks took different numbers of optimizer steps ({counts})" in rank["error"]
        assert rank["group_after"] == 2.0


@pytest.mark.process
def test_a_grad_scaler_that_skips_a_step_on_one_rank_keeps_the_ranks_in_step(in_a_group):
    """The fp16 recipe: torch.amp.GradScaler skips optimizer.step() (and the optimizer's hooks) on the rank whose
    gradients overflowed. Inside `with diloco:` that rank fell a step behind and gloo aborted both; now finish()
    refuses on both, naming the counts and the recipe. The documented recipe, diloco.step() after
    scaler.step(optimizer) at every iteration, counts the skipped step on that rank too: both end on θ."""
    for rank in in_a_group["scaler-hooked"]:
        assert "(rank 0: 10, rank 1: 9)" in rank["error"] and "call diloco.step() after scaler.step" in rank["error"]
    ranks = in_a_group["scaler-recipe"]
    assert [r["steps"] for r in ranks] == [10, 10] and all(r["alike_at_the_end"] for r in ranks)
    assert ranks[1]["scale"] < ranks[0]["scale"]  # rank 1's scaler did skip a step (and halved its scale)


def test_adloco_with_the_loops_own_backward_warns_once_that_b_cannot_move():
    """method='adloco' measures the batch's statistics in diloco.batch.backward; a loop that runs its own
    loss.backward() measures none, so b never moves: said once, at the first round that should have measured."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="measured no batch statistics") as caught:
        with DiLoCo(model, optimizer, sync_every=2, method="adloco", batch={"size": 2}) as diloco:
            _steps(model, optimizer, 6)  # three rounds
        diloco.finish()
    assert sum("measured no batch statistics" in str(w.message) for w in caught) == 1


def test_the_adaptive_batch_of_a_diloco_without_one_is_a_clear_error():
    """diloco.batch without method='adloco': false, and its use says what it is instead of Python's
    "'NoneType' object has no attribute 'backward'"."""
    model = _model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    assert not diloco.batch
    with pytest.raises(AttributeError, match=r"diloco.batch.backward: diloco.batch is AdLoCo's adaptive batch"):
        diloco.batch.backward(lambda x: model(x).sum(), torch.ones(2, 4))


@pytest.mark.process
def test_a_forgotten_finish_is_said_when_the_object_goes_or_the_process_ends():
    """Without finish() each rank keeps its own drifted model, not θ: a warning when the DiLoCo object is collected,
    or at the process's exit; none after finish()."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DiLoCo(model, optimizer, sync_every=2) as diloco:
        _steps(model, optimizer, 5)
    with pytest.warns(UserWarning, match=r"finish\(\) was never called after 2 round\(s\)"):
        del diloco
        gc.collect()
    # hooked with hook() (Lightning's way), then the model and optimizer dropped too: still collected, still said
    hooked_model = _model()
    hooked_optimizer = torch.optim.SGD(hooked_model.parameters(), lr=0.1)
    hooked = DiLoCo(hooked_model, hooked_optimizer, sync_every=2)
    hooked.hook()
    _steps(hooked_model, hooked_optimizer, 4)
    with pytest.warns(UserWarning, match=r"finish\(\) was never called after 2 round\(s\)"):
        del hooked, hooked_model, hooked_optimizer
        gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        finished = DiLoCo(model, optimizer, sync_every=2)
        finished.step()
        finished.finish()
        del finished
        gc.collect()
    probe = """
import torch
from adloco import DiLoCo
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with DiLoCo(model, optimizer, sync_every=2) as diloco:
    for _ in range(4):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""
    result = subprocess.run([sys.executable, "-W", "default", "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "finish() was never called after 2 round(s)" in result.stderr


@pytest.mark.process
def test_a_setting_that_differs_between_ranks_is_named(in_a_group):
    """Rank 0 builds DiLoCo with sync_every=4, rank 1 with 8: both refuse, naming sync_every alone (not a list of
    every setting that might have differed)."""
    for rank in in_a_group["settings-differ"]:
        assert rank["error"] == "the ranks' DiLoCo settings differ in sync_every: every rank must build the same DiLoCo"


def test_optimizer_steps_outside_diloco_are_warned_about_once():
    """A warm-up before `with diloco:` and steps after it move the model where no round counts them: one warning
    each time it happens to an object, none for the loop inside the context or with diloco.step()."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=2)
    _steps(model, optimizer, 3)  # a warm-up before entering
    warm_up = r"3 optimizer step\(s\) ran before this inner step outside DiLoCo"
    with pytest.warns(UserWarning, match=warm_up) as seen, diloco:
        _steps(model, optimizer, 4)
    assert len([w for w in seen if "outside DiLoCo" in str(w.message)]) == 1
    after = DiLoCo(model, optimizer, sync_every=2)
    with after:
        _steps(model, optimizer, 4)
    _steps(model, optimizer, 2)  # after leaving
    with pytest.warns(UserWarning, match=r"2 optimizer step\(s\) ran after the last inner step outside DiLoCo"):
        after.finish()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside = DiLoCo(model, optimizer, sync_every=2)
        with inside:
            _steps(model, optimizer, 3)
        inside.finish()
        manual = DiLoCo(model, optimizer, sync_every=2)
        for _ in range(3):
            _steps(model, optimizer, 1)
            manual.step()
        manual.before_step()  # a step a loss scaler skipped: no optimizer step, and no warning
        manual.finish()


@pytest.mark.process
def test_a_model_restored_before_diloco_is_built_is_refused_and_the_documented_order_resumes(in_a_group):
    """Restoring mid-round in the natural order (the model's state, then DiLoCo(...)) would train on from rank 0's
    model on every rank: refused on both ranks; the documented order (DiLoCo, then the model, optimizer and DiLoCo
    states) goes on to the bits of the run that never stopped, and so does a framework's restore (rank 0's model on
    every rank before DiLoCo(...), each rank's own after it), where rank 0's model alone holds θ."""
    for rank in in_a_group["restore-order"]:
        assert "error" not in rank, rank["error"]
        assert "saved mid-round and the model still holds rank 0's parameters" in rank["wrong_order"]
        assert rank["resumed_identical"] and rank["framework_identical"]


def test_a_loop_that_stops_on_its_budget_with_samples_read_stops_within_a_step():
    """diloco.batch.samples_done moves at round ends only (a loop stopping on it ran up to a round past its budget,
    20-60 % with b growing); samples_read counts the round in progress too, so the documented budget loop stops
    within one step of the budget, and at finish() samples_done holds exactly what the loop read."""
    data = torch.randn(4096, 4, generator=torch.Generator().manual_seed(0))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pinned = {
        "size": 1,
        "b_cap": 16,
        "time": {"step_seconds": [0.01, 0.001], "round_seconds": 0.05, "min_steps_left": 1},
    }
    budget = 200
    diloco = DiLoCo(model, optimizer, sync_every=4, method="adloco", batch=pinned, total_samples=budget)
    read, last = 0, 0
    with diloco:
        for indices in diloco.batch.sampler(len(data), seed=1):
            if diloco.batch.samples_read >= budget:
                break
            x = data[indices]
            diloco.batch.backward(lambda x: torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()), x)
            optimizer.step()
            optimizer.zero_grad()
            read, last = read + len(indices), len(indices)
            assert diloco.batch.samples_read == read  # every step counted, not only at the round's end
    diloco.finish()
    assert diloco.batch.size > 1  # b grew, so rounds grew in samples
    assert budget <= read < budget + last
    assert diloco.batch.samples_done == read


def test_the_inner_lr_the_docs_describe_is_the_schedules():
    """The inner lr: linear warm-up, then the cosine counted from token 0, not from the warm-up's end, so the lr
    steps down after the warm-up; the docs give the default run's numbers (a warm-up reading a quarter of the
    budget: 1e-3 at step 100, 8.68e-4 at step 101), which are the schedule's."""
    from adloco.algorithms.schedules import inner_lr

    assert inner_lr(99, 0.25, 1e-3, 1e-4, 100) == 1e-3  # the warm-up's last step (0-based 99: step 100)
    after = inner_lr(100, 0.25, 1e-3, 1e-4, 100)
    assert f"{after:.2e}" == "8.68e-04"  # the cosine at a quarter of the budget, not at its start (1e-3)
    docs = Path(__file__).parents[2] / "docs"
    for page in ("own-loop.md", "design.md"):
        text = " ".join((docs / page).read_text().split())
        assert "counted from token 0" in text or "counts from token 0" in text
        assert "8.68e-4" in text


def test_the_streaming_schedule_set_beside_torchfts_is_adlocos():
    """docs/streaming-and-codecs.md's table for H = 10, P = 2, τ = 1: adloco takes fragment 1's Δ at step 5 and lands
    it at 6, fragment 0's at 10 and 11 (torchft: fragment 0 at 4 and 5, fragment 1 at 9 and 10)."""
    from adloco.algorithms.schedules import fragments_receiving_at, fragments_sending_at

    sends = {t: fragments_sending_at(t, 10, 2) for t in range(1, 12)}
    lands = {t: fragments_receiving_at(t, 10, 2, 1) for t in range(1, 12)}
    assert {t: f for t, f in sends.items() if f} == {5: [1], 10: [0]}
    assert {t: f for t, f in lands.items() if f} == {6: [1], 11: [0]}
    page = " ".join((Path(__file__).parents[2] / "docs" / "streaming-and-codecs.md").read_text().split())
    assert "| adloco: takes Δ of | | fragment 1 | | | fragment 0 | |" in page
    assert "| adloco: lands | | | fragment 1 | | | fragment 0 |" in page
