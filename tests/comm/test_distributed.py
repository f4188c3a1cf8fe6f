"""Real torch.distributed processes (gloo on loopback) against the in-process engine."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adloco.algorithms.sharding import ShardLayout
from adloco.checkpoint import list_checkpoints, load_checkpoint
from adloco.comm.distributed import DistributedCommunicator
from adloco.config import build_config, resume_config
from adloco.config.input import layered
from adloco.metrics.writer import read_metrics
from adloco.run.training import train
from adloco.tools.gradients import load_parameters
from tests.conftest import PINNED_PACE, cut_back, final_params, same_params

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

BASE = [
    "model.context=16",
    "batch.size=2",
    "inner.warmup_steps=2",
    "eval.every=2",
    "eval.blocks=8",
    "eval.final_full=false",
    "run.progress=false",
    "run.plots=false",
    "threads=1",  # the same kernels in every process, so bits can be compared
]
DILOCO = [*BASE, "method=diloco", "workers=4", "sync_every=4", "total_tokens=1024"]
# outer Adam: its two moments and step count are mirrored to the ranks hosting none of a trainer and merged
ADLOCO = [*BASE, "method=adloco", "trainers=4", "workers=1", "batch.b_cap=8", "sync_every=3", "merge.every=1",
          "total_tokens=4608", "outer.optimizer=adam", *PINNED_PACE]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONFAULTHANDLER"] = "1"  # a process that aborts in native code prints every thread's Python stack
    return env


def _torchrun_command(ranks: int, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "adloco",
        "train",
        *layered(args),
    ]


def _torchrun(ranks: int, args: list[str], cwd, timeout=240) -> subprocess.CompletedProcess:
    command = _torchrun_command(ranks, args)
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_communicator_ends_the_group_it_made_and_leaves_a_programs_own(tmp_path, monkeypatch):
    """One rank in the test's process: adloco train's communicator makes the group from torchrun's variables and ends
    it when the run closes it; a group the program made first outlives the run (the program may train another), and
    its backend is the one the communicator uses, whatever the config asked."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                        "GLOO_SOCKET_IFNAME": "lo"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    try:
        DistributedCommunicator(backend="gloo", timeout_s=30).close()
        assert not torch.distributed.is_initialized()
        torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                             rank=0, world_size=1)  # fmt: skip
        comm = DistributedCommunicator(backend="nccl", timeout_s=30)
        assert (comm.backend, comm.device.type) == ("gloo", "cpu")
        comm.close()
        assert torch.distributed.is_initialized()
    finally:  # a failure here leaves no group behind for the next test in this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def diloco_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of DILOCO in this process, one rank hosting its 4 workers: the reference the two-rank
    jobs of DILOCO are compared with, trained once for all of them (only read)."""
    root = tmp_path_factory.mktemp("diloco-reference")
    return train(build_config(overrides=[*DILOCO, f"run.root={root}", "run.name=local"])).run_dir


@pytest.mark.process
def test_diloco_two_ranks_of_two_slots_equal_one_rank_of_four(tmp_path, diloco_reference):
    result = _torchrun(2, [*DILOCO, f"run.root={tmp_path}", "run.name=dist", "run.plots=true"], cwd=tmp_path)
    assert result.stdout.count("final validation loss") == 1  # rank 0 speaks for the job
    assert (tmp_path / "dist" / "plots" / "loss.png").is_file()
    assert same_params(final_params(diloco_reference), final_params(tmp_path / "dist"))
    rounds = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["rank"] for r in rounds[0]["ranks"]] == [0, 1]
    assert all(r["wire_bytes"] > 0 and r["comm_seconds"] >= 0 for r in rounds[0]["ranks"])
    local_rounds = [r for r in read_metrics(diloco_reference / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["bytes"] for r in rounds] == [r["bytes"] for r in local_rounds]


@pytest.mark.process
def test_adloco_merges_hand_ranks_over_and_match_in_process(tmp_path):
    local = train(build_config(overrides=[*ADLOCO, f"run.root={tmp_path}", "run.name=local"]))
    _torchrun(
        4, [*ADLOCO, f"run.root={tmp_path}", "run.name=dist", "checkpoint.every=1", "checkpoint.keep=50"], tmp_path
    )
    dist_dir = tmp_path / "dist"
    merges = [r for r in read_metrics(dist_dir / "metrics.jsonl") if r["kind"] == "merge"]
    assert len(merges) == 3 and merges[-1]["workers"] == [0, 1, 2, 3]  # ranks 1-3 now work for trainer 0
    assert same_params(final_params(local.run_dir), final_params(dist_dir))

    # Resume the 4-rank job on 2 ranks from the checkpoint after round 1 (same worker count).
    partial = cut_back(dist_dir, tmp_path / "partial", keep=2)
    env_args = ["--resume", str(partial)]
    _torchrun(2, env_args, cwd=tmp_path)
    assert same_params(final_params(local.run_dir), final_params(partial))


# -- sharded workers (HSDP) ------------------------------------------------------------------------------------------

SHARDED = [*BASE, "method=adloco", "workers=2", "sync_every=4", "total_tokens=2048", "batch.size=3",
           "batch.controller=test", "batch.statistics.eta=0.3", "batch.b_cap=8", *PINNED_PACE, "checkpoint.every=1",
           "checkpoint.keep=10"]  # fmt: skip


@pytest.mark.process
def test_two_workers_of_two_shards_match_unsharded_workers_with_half_the_bytes_per_rank(tmp_path):
    """4 ranks, each worker's model sharded over 2 of them with FSDP2: the run of 2 unsharded workers, up to the
    order of float additions (the shards' partial gradients are summed); each rank exchanges only its rows. The
    sharded checkpoints resume bit-identically and are cut anew for another shard count, as single files are."""
    local = train(build_config(overrides=[*SHARDED, f"run.root={tmp_path}", "run.name=local"]))
    _torchrun(4, [*SHARDED, "shards=2", f"run.root={tmp_path}", "run.name=dist"], cwd=tmp_path)
    dist_dir = tmp_path / "dist"
    expected, got = final_params(local.run_dir), final_params(dist_dir)
    assert _within(expected, got, 1e-5)
    assert not same_params(expected, got)  # the sums do run in another order: the comparison has teeth
    rounds = [r for r in read_metrics(dist_dir / "metrics.jsonl") if r["kind"] == "round"]
    local_rounds = [r for r in read_metrics(local.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["batch"] for r in rounds] == [r["batch"] for r in local_rounds]
    assert rounds[-1]["batch"]["0"] > 3  # the batch test grew b (from the shards' summed statistics)
    half_of_theta = 4 * sum(t.numel() for t in got.values()) / 2
    for rank in rounds[-1]["ranks"]:  # its rows of its worker's pseudo-gradient, and the worker's report
        assert half_of_theta < rank["wire_bytes"] < 1.01 * half_of_theta

    model, _, _ = load_parameters(dist_dir, "latest")  # adloco gradients' reader
    assert same_params(got, {name: p.detach() for name, p in model.named_parameters()})

    partial = cut_back(dist_dir, tmp_path / "partial", keep=2)
    _torchrun(4, ["--resume", str(partial)], cwd=tmp_path)
    assert same_params(got, final_params(partial))

    # 2 shards -> 1, trained on in one process; 1 -> 2, the rows each shard reads of the unsharded run's file.
    narrowed = cut_back(dist_dir, tmp_path / "narrowed", keep=2)
    train(resume_config(narrowed, ["shards=1"]), resume=narrowed)
    assert _within(expected, final_params(narrowed), 1e-5) and not same_params(expected, final_params(narrowed))
    whole = load_checkpoint(list_checkpoints(local.run_dir / "checkpoints")[1])["cluster"]
    shapes = {tuple(t.shape) for t in whole["trainers"][0]["theta"]}
    for shard in (0, 1):
        layout = ShardLayout(shard, 2, lambda: shapes)
        cut = load_checkpoint(list_checkpoints(local.run_dir / "checkpoints")[1], layout=layout)["cluster"]
        for rows, full in zip(cut["trainers"][0]["theta"], whole["trainers"][0]["theta"], strict=True):
            assert torch.equal(rows, torch.chunk(full, 2)[shard])
        moments = cut["workers"][shard]["optimizer"]["state"][0]["exp_avg"]
        assert torch.equal(moments, torch.chunk(whole["workers"][shard]["optimizer"]["state"][0]["exp_avg"], 2)[shard])


def _within(expected: dict, got: dict, tolerance: float) -> bool:
    return expected.keys() == got.keys() and all(
        torch.allclose(expected[k], got[k], atol=tolerance, rtol=0) for k in expected
    )


def _wait_for_round(metrics, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and '"kind": "round"' in metrics.read_text():
            return
        time.sleep(0.05)


def _launch_two_ranks(tmp_path, name: str, timeout_s: int, method: list[str] | None = None) -> list[subprocess.Popen]:
    """Two ranks started by hand (as torchrun would), a long run, and a wait until the first round is logged."""
    port = _free_port()
    args = [*DILOCO, "workers=2", *(method or []), "total_tokens=100000", f"run.root={tmp_path}", f"run.name={name}"]
    procs = []
    for rank in range(2):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        command = [sys.executable, "-m", "adloco", "train", *layered(args, [f"comm.timeout_s={timeout_s}"])]
        procs.append(
            subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    _wait_for_round(tmp_path / name / "metrics.jsonl", procs)
    return procs


@pytest.mark.process
def test_a_hung_rank_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 is frozen mid-run (SIGSTOP); rank 0 must give up after comm.timeout_s with a clear message."""
    procs = _launch_two_ranks(tmp_path, "hang", timeout_s=6)
    try:
        assert (tmp_path / "hang" / "metrics.jsonl").exists(), "the job never completed a round"
        procs[1].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=90)
        waited = time.monotonic() - frozen_at
        assert procs[0].returncode == 1
        assert "rank 0 lost contact with the other ranks" in stderr
        assert "Traceback" not in stderr
        assert waited < 6 + 30  # the timeout plus a bounded margin for the step in flight
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.communicate(timeout=30)


@pytest.mark.process
def test_a_killed_rank_ends_the_job(tmp_path):
    procs = _launch_two_ranks(tmp_path, "kill", timeout_s=20)
    try:
        assert (tmp_path / "kill" / "metrics.jsonl").exists(), "the job never completed a round"
        procs[1].kill()
        killed_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 1
        assert "lost contact with the other ranks" in stderr and "Traceback" not in stderr
        assert time.monotonic() - killed_at < 20 + 30
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


# -- two-rank jobs sharing one launch --------------------------------------------------------------------------------

STREAMING = [*DILOCO, "method=streaming", "streaming.fragments=2", "streaming.overlap=1", "codec.name=topk",
             "codec.density=0.05", "inner.optimizer=muon"]  # fmt: skip
EAGER = [*DILOCO, "outer.overlap=eager"]
AUTO_4_TO_16 = ["sync_auto.min=4", "sync_auto.start=4", "sync_auto.max=16", *PINNED_PACE]
# How often two ranks meet: (method, exchanges per round or None, H), by job name.
MEETINGS = {
    "diloco": (["method=diloco", "workers=2"], 1, "8"),  # Δ and every worker's round report in one collective
    # one per fragment, and the reports, whatever H: sync_every=auto on pinned costs takes H from 4 to 16 in one
    # launch, and both ranks must choose the same H every round or the run would hang
    "streaming": (["method=streaming", "workers=2", "streaming.fragments=2", *AUTO_4_TO_16], 3, "auto"),
    # one trainer per rank: the round's exchange within each, and each trainer's state shared with the other
    "adloco": (["method=adloco", "trainers=2", "workers=1", "merge.every=100", "batch.b_cap=4"], None, "4"),
}


def _meeting(method: list[str], sync_every: str) -> list[str]:
    tokens = 16 * 8 * 3 * (8 if sync_every == "auto" else int(sync_every))
    return [*BASE, "batch.size=1", *method, f"sync_every={sync_every}", f"total_tokens={tokens}"]


STOPPABLE = [*DILOCO, "workers=2", "total_tokens=8192", "checkpoint.every=1000"]
SHARDED_CHECKPOINTS = [*DILOCO, "workers=2", "total_tokens=512", "checkpoint.every=1", "checkpoint.format=sharded"]

# The two-rank jobs compared with one process or counted, or started from, trained one after another in one launch.
TWO_RANK_JOBS = {
    "allreduce": [*DILOCO, "comm.reduce=allreduce"],
    "eager": EAGER,
    "streaming": STREAMING,
    **{f"meet-{name}": _meeting(method, h) for name, (method, _, h) in MEETINGS.items()},
    "ddp": [*BASE, "method=ddp", "workers=2", "sync_every=4", "total_tokens=1024"],
    # a run never stopped that checkpoints at every round's end (on the time cadence, which both ranks must agree on)
    "timed": [*STOPPABLE, "checkpoint.every_minutes=1e-9", "checkpoint.keep=1000"],
    "sharded-checkpoints": SHARDED_CHECKPOINTS,
}
# the tests reading the shared launch run in one test process (pytest-xdist), so it is made once
shared_launch = pytest.mark.xdist_group("two-rank-jobs")


@pytest.fixture(scope="module")
def two_rank_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root holding every job of TWO_RANK_JOBS, each in its run directory of the same name."""
    root = tmp_path_factory.mktemp("two-rank-jobs")
    jobs = {name: layered(items, [f"run.root={root}", f"run.name={name}"]) for name, items in TWO_RANK_JOBS.items()}
    (root / "jobs.json").write_text(json.dumps(jobs))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(Path(__file__).with_name("two_rank_jobs.py")),
               str(root / "jobs.json")]  # fmt: skip
    timeout = 120 + 60 * len(jobs)  # a minute a job, where each takes a few seconds
    result = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.process
@shared_launch
def test_streaming_with_a_codec_and_muon_matches_in_process(tmp_path, two_rank_jobs):
    """One rank of 4 stacked workers against 2 ranks of 2: Muon steps each worker's matrices the same either way,
    and the top-k payloads (with their error feedback) gather to the same mean."""
    local = train(build_config(overrides=[*STREAMING, f"run.root={tmp_path}", "run.name=local"]))
    assert same_params(final_params(local.run_dir), final_params(two_rank_jobs / "streaming"))


@pytest.mark.process
@shared_launch
def test_allreduce_mode_agrees_with_the_exact_sum(diloco_reference, two_rank_jobs):
    """comm.reduce=allreduce pre-sums a rank's slots and all-reduces: same result up to summation order."""
    expected, got = final_params(diloco_reference), final_params(two_rank_jobs / "allreduce")
    assert all(torch.allclose(expected[k], got[k], atol=1e-5, rtol=1e-4) for k in expected)
    rounds = [r for r in read_metrics(two_rank_jobs / "allreduce" / "metrics.jsonl") if r["kind"] == "round"]
    params = sum(t.numel() for t in got.values())
    # each rank hands the backend one summed pseudo-gradient (counted twice for the ring's two phases)
    assert rounds[-1]["ranks"][0]["wire_bytes"] >= 2 * 4 * params


@pytest.mark.process
@shared_launch
def test_eager_overlap_matches_in_process(tmp_path, two_rank_jobs):
    """Eager updates keep an exchange in flight across a whole round: 2 ranks still give the in-process bits."""
    local = train(build_config(overrides=[*EAGER, f"run.root={tmp_path}", "run.name=local"]))
    assert same_params(final_params(local.run_dir), final_params(two_rank_jobs / "eager"))


def _exchanges_per_round(run_dir: Path) -> list[list[int]]:
    """Per round after the first (which holds the start-up handshake) and before the last (maybe shorter):
    each rank's count of blocking exchanges."""
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert len(rounds) >= 3
    return [[rank["exchanges"] for rank in r["ranks"]] for r in rounds[1:-1]]


@pytest.mark.process
@shared_launch
@pytest.mark.parametrize("method", list(MEETINGS))
def test_ranks_meet_a_fixed_number_of_times_per_round_whatever_h(two_rank_jobs, method):
    """2 ranks: low-communication methods meet per round, not per inner step."""
    _, per_round, sync_every = MEETINGS[method]
    counts = _exchanges_per_round(two_rank_jobs / f"meet-{method}")
    assert len({n for r in counts for n in r}) == 1, counts
    if per_round is not None:
        assert counts[0] == [per_round, per_round]
    if sync_every == "auto":
        rounds = [r for r in read_metrics(two_rank_jobs / f"meet-{method}" / "metrics.jsonl") if r["kind"] == "round"]
        assert [r["sync_every"] for r in rounds[:4]] == [4, 16, 16, 16]


@pytest.mark.process
@shared_launch
def test_ddp_meets_once_per_inner_step(two_rank_jobs):
    rounds = _exchanges_per_round(two_rank_jobs / "ddp")
    assert rounds and all(r == [4, 4] for r in rounds)


# -- stop signals under torchrun -------------------------------------------------------------------------------------


@pytest.mark.process
@shared_launch
def test_sigterm_to_torchrun_stops_both_ranks_at_one_boundary_and_the_resume_is_bit_identical(tmp_path, two_rank_jobs):
    """torchrun passes SIGTERM to its workers; they stop at the same round end, rank 0 checkpoints, and a
    resume gives the bits of a run never stopped (one that checkpointed every round on the time cadence)."""
    reference = two_rank_jobs / "timed"
    rounds = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "round"]
    assert len(list_checkpoints(reference / "checkpoints")) == len(rounds)  # both ranks agreed on every one

    args = [*STOPPABLE, f"run.root={tmp_path}", "run.name=stopped"]
    job = subprocess.Popen(
        _torchrun_command(2, args), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_round(tmp_path / "stopped" / "metrics.jsonl", [job])
    job.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, err = job.communicate(timeout=120)
    assert time.monotonic() - signalled < 25, err[-2000:]  # within torchrun's 30 s grace: no rank was left waiting
    assert "forcefully exiting" not in err
    checkpoints = list_checkpoints(tmp_path / "stopped" / "checkpoints")
    assert len(checkpoints) == 1, err[-2000:]
    run_dir = tmp_path / "stopped"
    stopped_lines = [line for line in err.splitlines() if "adloco: stopped on SIGTERM" in line]
    assert stopped_lines == [
        f"adloco: stopped on SIGTERM: checkpoint of round {int(checkpoints[0].stem.split('_')[1])} in "
        f"{run_dir}; resume with: adloco train --resume {run_dir}"
    ]  # one line for the job, from rank 0
    assert 0 < int(checkpoints[0].stem.split("_")[1]) < len(rounds)
    _torchrun(2, ["--resume", str(run_dir)], cwd=tmp_path)
    assert same_params(final_params(reference), final_params(run_dir))


@pytest.mark.process
@pytest.mark.parametrize(
    "method",
    [
        # (DiLoCo's ranks stopping at one round's end: the SIGTERM test above; DDP's request rides in its report of
        # every inner step, the same path as DiLoCo's round reports)
        ["method=adloco", "trainers=2", "workers=1", "merge.every=100", "batch.b_cap=4"],  # one trainer per rank
    ],
)
def test_a_signal_to_one_rank_stops_both_at_the_same_round(tmp_path, method):
    procs = _launch_two_ranks(tmp_path, "usr1", timeout_s=20, method=method)
    try:
        assert all(p.poll() is None for p in procs), "the job ended before the signal"
        procs[1].send_signal(signal.SIGUSR1)
        outputs = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [128 + signal.SIGUSR1] * 2, outputs
        assert "adloco: rank 1: SIGUSR1 received; stopping at a round's end" in outputs[1]
        assert outputs[0].strip().splitlines()[-1].startswith("adloco: stopped on SIGUSR1: checkpoint of round ")
        assert "adloco: stopped" not in outputs[1]  # rank 0 speaks for the job
        assert len(list_checkpoints(tmp_path / "usr1" / "checkpoints")) == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)


# An elastic job that loses a machine and gets it back: (workers = ranks, token budget so far) per launch.
ELASTIC = [*BASE, "method=diloco", "sync_every=2", "elastic=true", "checkpoint.every=1"]
RESIZES = [(3, 384), (2, 640), (3, 1024)]


@pytest.mark.process
def test_an_elastic_job_goes_from_3_to_2_to_3_ranks_as_in_one_process(tmp_path):
    """Each torchrun launch resumes the run with another world size, as a restart after a machine left or joined
    does; the in-process run resized by ``workers=`` on resume (with single-file checkpoints) gives the same bits."""
    local = train(build_config(overrides=[*ELASTIC, "workers=3", "total_tokens=384", f"run.root={tmp_path}"]))
    for workers, budget in RESIZES[1:]:
        config = resume_config(local.run_dir, [f"workers={workers}", f"total_tokens={budget}"])
        train(config, resume=local.run_dir)

    # The job writes sharded checkpoints (a file per rank), which each launch reads with another rank count.
    dist = tmp_path / "dist"
    sharded = ["checkpoint.format=sharded", "checkpoint.keep=1"]
    _torchrun(3, [*ELASTIC, *sharded, "total_tokens=384", f"run.root={tmp_path}", "run.name=dist"], cwd=tmp_path)
    for (before, _), (ranks, budget) in zip(RESIZES, RESIZES[1:], strict=False):
        (newest,) = list_checkpoints(dist / "checkpoints")
        assert sorted(p.name for p in newest.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(before)]
        result = _torchrun(ranks, ["--resume", str(dist), f"total_tokens={budget}"], cwd=tmp_path)
        assert result.stderr.count(f"workers: {before} -> {ranks}") == 1  # the change, said once on the terminal

    assert same_params(final_params(local.run_dir), final_params(dist))
    records = read_metrics(dist / "metrics.jsonl")
    resizes = [(r["workers_before"], r["workers"]) for r in records if r["kind"] == "resize"]
    assert resizes == [(3, 2), (2, 3)]
    rounds = [r for r in records if r["kind"] == "round"]
    local_rounds = [r for r in read_metrics(local.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["train_loss"] for r in rounds] == [r["train_loss"] for r in local_rounds]
    assert [len(r["ranks"]) for r in rounds] == [3, 3, 2, 2, 3, 3]


@pytest.mark.process
@shared_launch
def test_a_damaged_newest_sharded_checkpoint_is_said_once_on_the_console_and_the_one_before_used(
    tmp_path, two_rank_jobs
):
    """The job's sharded checkpoints: the newest loses DCP's .metadata; every rank falls back to the same older one
    and rank 0 says so on the terminal, naming the damage and the round it resumes from."""
    run_dir = tmp_path / "job"
    shutil.copytree(two_rank_jobs / "sharded-checkpoints", run_dir)  # the job of SHARDED_CHECKPOINTS, damaged here
    older, newest = list_checkpoints(run_dir / "checkpoints")[-2:]
    (newest / ".metadata").unlink()
    result = _torchrun(2, ["--resume", str(run_dir), "total_tokens=768"], cwd=tmp_path)
    ours = [line for line in result.stderr.splitlines() if line.startswith("adloco: ")]
    assert ours[:2] == [
        f"adloco: warning: checkpoint '{newest}' is damaged (file .metadata is missing or fails its checksum)",
        f"adloco: resuming from the checkpoint of round {int(older.name.split('_')[1])}, the newest intact one; "
        "the rounds after it are trained again",
    ], result.stderr[-3000:]
    rounds = [r["round"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert rounds == [1, 2, 3]  # 256 tokens a round: the lost round 2 trained again, recorded once
