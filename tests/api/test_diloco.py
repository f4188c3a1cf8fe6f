"""adloco.DiLoCo in a user's own loop: the numbers of ``adloco train`` (real torchrun processes), resume from the
user's own checkpoint, state through torch.save and torch.distributed.checkpoint, and clear errors for bad use."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from adloco import DiLoCo, MuonWithAdamW, hidden_matrices
from adloco.config import ConfigError, build_config
from adloco.config.input import layered
from adloco.run.training import train
from tests.comm.test_distributed import _env, _free_port
from tests.conftest import PINNED_PACE, final_params

LOOP = Path(__file__).with_name("adloco_train_loop.py")
SETTINGS = [
    "model.context=16",
    "workers=2",
    "batch.size=2",
    "sync_every=4",
    "inner.warmup_steps=2",
    "threads=1",
    "batched_workers=false",  # one worker per rank steps as a plain torch AdamW does
    "eval.every=1000",
    "eval.final_full=false",
    "eval.blocks=4",
    "run.plots=false",
    "run.progress=false",
    "run.trackers=[]",
]
MERGES = ["method=adloco", "trainers=2", "workers=1", "sync_every=2", "batch.size=1", "batch.controller=test",
          "batch.statistics.eta=1.5", "batch.b_cap=64", "merge.every=2", "total_tokens=1200"]  # fmt: skip
STREAMING_FP4 = ["method=streaming", "streaming.fragments=2", "streaming.overlap=1", "codec.name=fp4-e2m1",
                 "codec.error_feedback=true"]  # fmt: skip


def _loop(tmp_path: Path, out: Path, settings: list[str], *flags: str, script: Path = LOOP, ranks: int = 2) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(script), str(out), *flags, *settings]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=240, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.process
@pytest.mark.parametrize(
    ("method", "flags", "stop_after"),
    [
        # over a process group of the loop's own, stopped mid-round with a fragment in flight and resumed
        ([*STREAMING_FP4, "total_tokens=1280"], ["--own-group"], 9),
        # the loop clips before the hook averages the gradients, adloco train after: without clipping they agree
        (["method=ddp", "inner.clip=null", "total_tokens=512"], [], None),
        # (the time-aware controller at a fixed H on pinned costs: adloco train's replicas, which run this loop's
        # DiLoCo, against its plain run in tests/replicas/test_training.py)
        # two trainers of one worker each, their own batch tests (b 3 and 15), merged after round 2 (weights by b)
        (MERGES, [], None),
        # b and H chosen together: each candidate b weighed at the H the rule would choose (pinned costs)
        (
            [
                "method=adloco",
                "sync_every=auto",
                "sync_auto.start=2",
                "sync_auto.min=2",
                "sync_auto.max=16",
                "batch.size=1",
                "batch.b_cap=64",
                *PINNED_PACE,
                "total_tokens=2000",
            ],
            [],
            None,
        ),  # fmt: skip
    ],
    ids=[
        "streaming-fp4-ef-own-group-resumed-mid-round",
        "ddp",
        "adloco-merges",
        "adloco-auto",
    ],  # fmt: skip
)
def test_a_plain_loop_with_diloco_ends_on_the_bits_of_adloco_train(tmp_path, method, flags, stop_after):
    """Two torchrun ranks; the loop reads the samples adloco train's workers read. The streaming case exchanges
    over a process group of its own and stops after inner step 9 (mid-round, a fragment in flight), each rank
    saving its own checkpoint, and a second launch resumes from it. adloco train runs its two workers in this
    process: where they run does not change a bit (tests/comm/test_distributed.py), and it saves a launch."""
    settings = layered(SETTINGS, method)
    train(build_config(overrides=[*settings, f"run.root={tmp_path}", "run.name=cli"]))
    out = tmp_path / "loop.pt"
    if stop_after is not None:
        _loop(tmp_path, out, settings, *flags, f"--stop-after={stop_after}")
        assert not out.exists() and len(list(tmp_path.glob("loop.pt.rank*"))) == 2  # each rank its own
    _loop(tmp_path, out, settings, *flags)
    expected, got = final_params(tmp_path / "cli"), torch.load(out, weights_only=True)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.process
def test_workers_sharded_with_fsdp2_exchange_their_rows_and_resume_from_dcp(tmp_path):
    """4 torchrun ranks, 2 workers each sharded over 2 ranks with FSDP2 (examples/sharded_loop.py's loop), DiLoCo
    over the mesh's other dimension: the θ of the same 2 workers unsharded up to the order of float additions (each
    worker's gradient is the mean of its shards'), half the bytes per rank; stopped mid-round, saved with DCP and
    resumed by new objects, the same bits; the whole job or an HSDP mesh as the exchange refused on every rank; with
    sync_every="auto" every rank decides the same H from the whole workers' dispersion; AdLoCo's adaptive batch over
    the sharded workers (each rank reading its worker's whole batch) grows b as over the workers whole and ends on
    their θ up to the order of float additions, with measured costs every rank of a worker chooses the same b, and a
    worker's ranks that read different samples are refused on both."""
    out = tmp_path / "found.json"
    _loop(tmp_path, out, [], script=LOOP.with_name("sharded_loop_check.py"), ranks=4)
    for rank in json.loads(out.read_text()):
        assert rank["rounds"] == 3 and rank["moved"] > 1e-2  # it trained
        assert 0 < rank["difference"] < 1e-5 and not rank["identical"]
        assert rank["resumed_identical"]
        sharded, whole = rank["bytes"]
        assert 0.49 < sharded / whole < 0.51
        assert "shards of different rows of a sharded model" in rank["refusals"][0]
        assert "with a replicated dimension (HSDP)" in rank["refusals"][1]
    ranks = json.loads(out.read_text())
    # sync_every="auto": every shard of every worker decides alike, from the dispersion of the whole workers
    sharded, whole = ranks[0]["auto"]
    assert all(rank["auto"][0] == sharded for rank in ranks)
    assert sharded["dispersion"] == pytest.approx(whole["dispersion"], rel=1e-4)
    for rank in ranks:
        adaptive = rank["adaptive"]
        sharded, whole = adaptive["sizes"]
        assert sharded == whole and sharded[0] == 2 and max(sharded) > 2  # b grew, as over the whole workers
        assert adaptive["difference"] < 1e-5  # with FSDP's division by S not undone it ended 1.7e-2 off
        assert "read different samples for one inner step" in adaptive["refused"]
    by_worker = {}  # measured costs: each worker's ranks weighed the same step cost and chose the same b
    for worker, sizes, timed in (rank["adaptive"]["measured"] for rank in ranks):
        by_worker.setdefault(worker, []).append((sizes, timed))
    assert all(len(seen) == 2 and seen[0] == seen[1] for seen in by_worker.values())
    assert all(any(t is not None for t in seen[0][1]) for seen in by_worker.values())  # the costs were timed


# -- one process: a world of one worker ---------------------------------------------------------------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(model, optimizer, diloco, steps: int, start: int = 0) -> None:
    generator = torch.Generator().manual_seed(start)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"method": "streaming", "streaming": {"fragments": 2, "overlap": 1}},
        {"codec": {"name": "int8", "error_feedback": True}, "outer": {"overlap": "eager"}},
    ],
    ids=["diloco", "streaming", "int8-ef-eager"],
)
@pytest.mark.parametrize("saver", ["torch.save", "dcp"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_resumed_from_its_own_checkpoint_mid_round_goes_on_bit_identically(tmp_path, settings, saver):
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())
    model.append(torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = {"sync_every": 4, **settings}
    with DiLoCo(model, optimizer, **kwargs) as diloco:
        _train(model, optimizer, diloco, 6)  # 1.5 rounds
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": diloco.state_dict()}
        if saver == "torch.save":
            torch.save(state, tmp_path / "state.pt")
        else:
            dcp.save({"model": model, "optimizer": optimizer, "diloco": diloco}, checkpoint_id=tmp_path / "dcp")
        _train(model, optimizer, diloco, 7, start=6)
    diloco.flush()

    again = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())
    again.append(torch.nn.Linear(16, 1))
    optimizer2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    with DiLoCo(again, optimizer2, **kwargs) as resumed:
        if saver == "torch.save":
            saved = torch.load(tmp_path / "state.pt", weights_only=True)
            again.load_state_dict(saved["model"])
            optimizer2.load_state_dict(saved["optimizer"])
            resumed.load_state_dict(saved["diloco"])
        else:
            _train(again, optimizer2, resumed, 1, start=99)  # AdamW's state must exist for DCP to load into
            dcp.load({"model": again, "optimizer": optimizer2, "diloco": resumed}, checkpoint_id=tmp_path / "dcp")
        assert resumed.inner_step == 6 and resumed.round_step == 2
        _train(again, optimizer2, resumed, 7, start=6)
    resumed.flush()
    assert _same(diloco.theta, resumed.theta) and _same(model.parameters(), again.parameters())


def test_a_loop_with_muon_inner_steps_and_outer_adam_resumes_bit_identically(tmp_path):
    """MuLoCo in a user's loop: MuonWithAdamW as the inner optimizer, outer Adam from the outer section; the
    torch.save round trip of model, optimizer and DiLoCo state goes on with the same bits."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return model, MuonWithAdamW(model.parameters(), hidden_matrices(model), lr=1e-2)

    kwargs = {"sync_every": 4, "outer": {"optimizer": "adam", "lr": 0.01}}
    model, optimizer = build()
    assert len(optimizer.muon.param_groups[0]["params"]) == 2  # both Linear weights; biases go to AdamW
    with DiLoCo(model, optimizer, **kwargs) as diloco:
        _train(model, optimizer, diloco, 6)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": diloco.state_dict()},
                   tmp_path / "state.pt")  # fmt: skip
        _train(model, optimizer, diloco, 6, start=6)
    assert type(diloco.trainer.outers[0].optimizer) is torch.optim.Adam
    again, optimizer2 = build()
    with DiLoCo(again, optimizer2, **kwargs) as resumed:
        saved = torch.load(tmp_path / "state.pt", weights_only=True)
        again.load_state_dict(saved["model"])
        optimizer2.load_state_dict(saved["optimizer"])
        resumed.load_state_dict(saved["diloco"])
        _train(again, optimizer2, resumed, 6, start=6)
    assert _same(diloco.theta, resumed.theta) and _same(model.parameters(), again.parameters())


def test_localsgd_with_one_worker_is_plain_training():
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    with DiLoCo(model, optimizer, sync_every=3, method="localsgd") as diloco:
        _train(model, optimizer, diloco, 9)
    _train(reference, plain, None, 9)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # θ − (θ − θ_m) rounds; DESIGN test vector 4
    assert diloco.inner_step == 9 and diloco.round_step == 0


def test_the_loops_settings_are_its_sections_and_the_old_name_still_reads_them():
    model = _model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=3, outer={"lr": 0.5})
    assert (diloco.settings.method, diloco.settings.sync_every, diloco.settings.outer.lr) == ("diloco", 3, 0.5)
    with pytest.warns(DeprecationWarning, match="DiLoCo.config is now DiLoCo.settings"):
        assert diloco.config is diloco.settings


def test_the_outer_step_is_the_outer_optimizers_own():
    """Default: Nesterov SGD lr 1, momentum 0.5 on Δ = θ − θ_m; a factory puts any torch optimizer there."""
    for factory in (None, lambda params: torch.optim.Adam(params, lr=0.05)):
        model = _model()
        start = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with DiLoCo(model, optimizer, sync_every=2, outer_optimizer=factory) as diloco:
            _train(model, optimizer, diloco, 1)
            drifted = [p.detach().clone() for p in model.parameters()]
            _train(model, optimizer, diloco, 1, start=1)
        assert type(diloco.trainer.outers[0].optimizer) is (torch.optim.SGD if factory is None else torch.optim.Adam)
        assert _same(model.parameters(), diloco.theta)  # every worker restarts from θ
        assert not _same(diloco.theta, drifted) and not _same(diloco.theta, start)


def test_bad_use_is_one_clear_error():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        DiLoCo(model, "adam")
    with pytest.raises(ValueError, match="not the model's trainable parameters"):
        DiLoCo(model, torch.optim.SGD(_model(1).parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="streaming"):
        DiLoCo(model, optimizer, sync_every=5, method="streaming", streaming={"fragments": 2})
    with pytest.raises(ConfigError, match="method: 'hivemind' is not one of"):
        DiLoCo(model, optimizer, method="hivemind")
    with pytest.raises(ConfigError, match="unknown key 'outer.lrr'"):
        DiLoCo(model, optimizer, outer={"lrr": 0.7})
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        DiLoCo(model, optimizer, process_group=object())
    diloco = DiLoCo(model, optimizer, sync_every=2)
    with diloco, pytest.raises(RuntimeError, match="not twice"):
        diloco.step()
    with pytest.raises(RuntimeError, match="use `with diloco:`"):
        DiLoCo(model, optimizer, method="ddp").step()


def test_finish_ends_a_round_in_progress_so_no_step_is_lost():
    for method in ("localsgd", "ddp"):
        model, reference = _model(), _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with DiLoCo(model, optimizer, sync_every=4, method=method) as diloco:
            _train(model, optimizer, diloco, 6)  # a round and a half
        _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), None, 6)
        diloco.finish()
        assert diloco.inner_step == 6 and diloco.round_step == 0
        for got, want in zip(diloco.theta, reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # θ holds all six steps
        theta = [t.clone() for t in diloco.theta]
        diloco.finish()  # a second finish is nothing
        assert _same(theta, diloco.theta) and diloco.inner_step == 6
        with diloco, pytest.raises(RuntimeError, match="finish"):
            _train(model, optimizer, diloco, 1)  # its process group is let go of: no more training


def test_a_step_whose_end_never_came_is_closed_at_the_next_one():
    """A loss scaler that skips optimizer.step() skips its hooks: the step still counts, on every rank alike."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=2).hook(before=False)
    for _ in range(3):
        diloco.before_step()  # the step after it never ran (skipped)
    assert diloco.inner_step == 2 and diloco.round_step == 0 and diloco.last_round is not None


def test_a_state_is_refused_by_other_settings():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = DiLoCo(model, optimizer, sync_every=4).state_dict()
    with pytest.raises(ValueError, match="saved with other settings"):
        DiLoCo(model, optimizer, sync_every=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="no outer optimizer of its own"):
        DiLoCo(model, optimizer, method="localsgd", outer_optimizer=lambda p: torch.optim.Adam(p))


def test_a_framework_wrapper_that_averages_gradients_is_refused():
    from adloco.api.ddp import keep_gradients_local

    class FullyShardedDataParallel(torch.nn.Module):  # what FSDP's wrapper is called
        pass

    keep_gradients_local(FullyShardedDataParallel(), world_size=1)  # one rank: nothing is averaged
    with pytest.raises(ValueError, match="wrapped in FullyShardedDataParallel, which averages gradients"):
        keep_gradients_local(FullyShardedDataParallel(), world_size=2)


def test_auto_chooses_each_rounds_length_in_the_loop_and_keeps_it_in_its_state():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    bounds = {"min": 2, "max": 8, "start": 2}
    with DiLoCo(model, optimizer, sync_every="auto", sync_auto=bounds) as diloco:
        lengths, steps = [], 0
        while steps < 40:
            lengths.append(diloco.rounds.length)
            _train(model, optimizer, diloco, diloco.rounds.length, start=steps)
            steps += lengths[-1]
            decision = diloco.rounds.last
            assert decision is not None and decision.sync_every == diloco.rounds.length
    assert diloco.rounds.count == len(lengths) and diloco.inner_step == sum(lengths)
    assert all(2 <= h <= 8 for h in lengths)
    # the first boundary has no exchange time of a previous one yet; from the second on H follows the costs
    assert diloco.rounds.last.reason in ("grow", "shrink", "hold", "min", "max")
    fresh = _model()
    restored = DiLoCo(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), sync_every="auto", sync_auto=bounds)
    restored.load_state_dict(diloco.state_dict())
    assert restored.rounds.length == diloco.rounds.length and restored.rounds.count == diloco.rounds.count


def test_auto_lengthens_rounds_as_the_inner_lr_falls_below_its_peak():
    """The rule's drift scale H_d grows as the lr decays: read off the optimizer against the highest lr it had (a
    warm-up rising to it reads as the peak), or as the loop gives it (rounds.lr_ratio); the peak is in the state."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    bounds = {"min": 2, "max": 64, "start": 2, "drift_steps": 100.0}
    with DiLoCo(model, optimizer, sync_every="auto", sync_auto=bounds) as diloco:
        drift = []
        for lr, given in ((0.05, None), (0.1, None), (0.025, None), (0.025, 0.5)):  # warm-up, peak, decay, given
            optimizer.param_groups[0]["lr"] = lr
            diloco.rounds.lr_ratio = given
            _train(model, optimizer, diloco, diloco.rounds.length, start=diloco.inner_step)
            drift.append(diloco.rounds.last.drift_steps)
    assert drift == [200.0, 200.0, 800.0, 400.0]  # one worker: twice the two workers' drift_steps
    fresh = _model()
    restored = DiLoCo(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), sync_every="auto", sync_auto=bounds)
    restored.load_state_dict(diloco.state_dict())
    assert restored.rounds.peak_lr == 0.1


def test_a_state_saved_on_a_gpu_loads_into_a_model_on_the_cpu():
    """A heal or checkpoint from a peer whose model was on a GPU (cuda:1, say) lands in host memory for a model on
    the CPU, and whatever was saved in host memory stays there."""
    from adloco.api.loop_state import onto_device_of_model

    place = onto_device_of_model(torch.device("cpu"))
    storage = torch.arange(4.0).untyped_storage()
    assert place(storage, "cuda:1") is storage and place(storage, "cpu") is storage


@pytest.mark.process
def test_a_plain_pytorch_loop_does_not_load_the_model_library():
    """A loop of plain PyTorch pays for what it uses: DiLoCo over a model that is not an HF one never imports
    transformers (seconds of every start-up, a restarted replica's too)."""
    probe = """
import sys, torch
from adloco import DiLoCo
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with DiLoCo(model, optimizer, sync_every=2) as diloco:
    for _ in range(4):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
print(diloco.rounds.count, "transformers" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "False"]
