"""``adloco train`` as fault-tolerant replicas: real ``adloco train`` processes on loopback, an ``adloco
lighthouse`` process between them. Without a fault the replicas end on the bits of the plain run with as many
workers; a replica killed mid-run is left out, and started again with the same command it heals, its records in
its own metrics.jsonl going on where its first life's stopped; replicas all killed at once go on from their own
checkpoints."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adloco import build_config, train
from adloco.checkpoint import save_checkpoint
from adloco.config.input import layered
from adloco.metrics.plots import plot_run
from adloco.metrics.records import read_metrics
from tests.api.test_replica import _finish, _lighthouse, needs_torchft
from tests.comm.test_distributed import _env, _free_port, _within
from tests.conftest import FAST, PINNED_PACE, adloco_process, final_params, process_tree, same_params

DEADLINE_S = 300
REPLICA = ["model.context=16", "batch.size=2", "sync_every=4", "inner.warmup_steps=2", "eval.every=2", "eval.blocks=8",
           "eval.final_full=false", "run.plots=false", "run.progress=false", "threads=1",
           "fault_tolerance.host=127.0.0.1", "fault_tolerance.min_replicas=2",
           "fault_tolerance.quorum_timeout_s=60"]  # fmt: skip
# min_replicas=2 as the Lighthouse's: a majority of 3, so the job cannot split (docs/fault-tolerance.md); a quorum
# that never comes ends a replica with an error well before the test's deadline


# AdLoCo: the time-aware controller on pinned costs grows b from 1 (to 2 here, or 8 in the no-fault case)
ADLOCO = ["method=adloco", "batch.size=1", "batch.b_cap=2", *PINNED_PACE]


def _replica(root: Path, lighthouse: str, replica: int, replicas: int, tokens: int, *extra: str) -> subprocess.Popen:
    items = [*REPLICA, *extra, f"total_tokens={tokens}", f"run.root={root}", "run.name=job"]
    items += [f"fault_tolerance.lighthouse={lighthouse}", f"fault_tolerance.replica={replica}"]
    items += [f"fault_tolerance.replicas={replicas}", f"workers={replicas}"]
    command = [sys.executable, "-m", "adloco", "train", *layered(items)]  # later items win, as on a command line
    env = {**_env(), "RUST_LOG": "error", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root.parent
    )


def _rounds(root: Path, replica: int) -> list[dict]:
    path = root / "job" / f"replica{replica}" / "metrics.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == "round"] if path.exists() else []


@pytest.mark.process
@needs_torchft
@pytest.mark.parametrize(
    ("method", "rounds"),
    # (DiLoCo's replicas end on the plain run's bits in the test of replicas all killed below, and in the loop's
    # tests against torchrun: test_replica.py)
    [(["method=adloco", "batch.size=1", "batch.b_cap=64", "sync_every=2", *PINNED_PACE, "trainers=2"], 9)],
    ids=["adloco-trainers"],
)
def test_without_a_fault_replicas_of_adloco_train_end_on_the_bits_of_the_plain_run(tmp_path, method, rounds):
    """2048 tokens; AdLoCo: 2 trainers of one replica each (each replica steps both itself) merge at round 2 as the
    plain run's do, then b grows 2, 4, 8 over 9 rounds of 2 steps (each round's record says it, as the plain
    run's) and the budget cuts the last one short."""
    root, deadline = tmp_path / "runs", time.monotonic() + DEADLINE_S
    lighthouse, address = _lighthouse(min_replicas=2)
    try:
        assert _finish([_replica(root, address, r, 2, 2048, *method) for r in (0, 1)], deadline) == [0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    workers = ["workers=1"] if "trainers=2" in method else []  # 2 trainers of 1 worker each, merged at round 2
    plain = adloco_process("train", *FAST, *method, *workers, "batched_workers=false", "total_tokens=2048",
                           f"run.root={tmp_path / 'plain'}", "run.name=p")  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    expected = final_params(tmp_path / "plain" / "p")
    # the plain run evaluates every 2nd round and its last; the replicas every 2nd (the final record, the last)
    plain_records = read_metrics(tmp_path / "plain" / "p" / "metrics.jsonl")
    plain_val = {x["round"]: x["val_loss"] for x in plain_records if x["kind"] == "round" and x["val_loss"] is not None}
    plain_merges = [x for x in plain_records if x["kind"] == "merge"]
    evaluated = list(range(2, rounds + 1, 2))
    for r in (0, 1):
        assert same_params(final_params(root / "job" / f"replica{r}"), expected)
        records = _rounds(root, r)
        assert [x["round"] for x in records] == list(range(1, rounds + 1))
        assert all(x["participants"] == 2 and x["committed"] and not x["absent"] for x in records)
        val = {x["round"]: x["val_loss"] for x in records if x["val_loss"] is not None}
        assert list(val) == evaluated and val == {n: plain_val[n] for n in evaluated}  # θ's, to the bit
        merges = [x for x in read_metrics(root / "job" / f"replica{r}" / "metrics.jsonl") if x["kind"] == "merge"]
        assert [m["round"] for m in merges] == ([2] if "trainers=2" in method else [])
        assert [m["weights"] for m in merges] == [m["weights"] for m in plain_merges]
        if "method=adloco" in method:  # each trainer's b as decided at the round's end, as the plain run's records
            assert [x["batch"] for x in records] == [x["batch"] for x in plain_records if x["kind"] == "round"]


@pytest.mark.process
@needs_torchft
def test_a_replica_of_adloco_train_killed_mid_run_is_left_out_and_started_again_heals(tmp_path):
    """AdLoCo (b from 1 to 2): the one started again reads on in its stream from where the job's step puts it,
    having read past the samples of the steps it missed; every worker's stream handed out as many samples."""
    root, deadline = tmp_path / "runs", time.monotonic() + DEADLINE_S
    tokens = 36864  # about 390 steps of the 3 workers' 2 samples of 16 tokens (the killed one is back by ~30)
    lighthouse, address = _lighthouse(min_replicas=2)
    try:
        procs = [_replica(root, address, r, 3, tokens, *ADLOCO) for r in range(3)]
        while len(_rounds(root, 2)) < 3 and procs[2].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[2].kill()  # a few rounds in: its 3rd record is written at the start of its 4th round, so mid-round
        assert _finish([procs[2]], deadline) == [-9]
        first_life = _rounds(root, 2)
        back = _replica(root, address, 2, 3, tokens, *ADLOCO)
        assert _finish([procs[0], procs[1], back], deadline) == [0, 0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    survivors = [_rounds(root, r) for r in (0, 1)]
    for records in survivors:  # every round of theirs committed but at most the one replica 2 died in (dropped,
        # not redone); it was missing from that one or from rounds after it (none when it was back at once)
        dropped = [x["round"] for x in records if not x["committed"]]
        assert len(dropped) <= 1 and all(n > first_life[-1]["round"] for n in dropped)
        assert any(2 in x["absent"] for x in records if x["round"] > first_life[-1]["round"])
    records = _rounds(root, 2)  # both lives, appended
    second_life = records[len(first_life) :]
    assert second_life[0]["healed"] and second_life[0]["round"] > first_life[-1]["round"] + 1
    assert 0 < second_life[0]["process_seconds"] < DEADLINE_S  # its recovery: process start to a committed round
    assert second_life[-1]["round"] == survivors[0][-1]["round"]
    assert second_life[-1]["step"] == survivors[0][-1]["step"] == survivors[1][-1]["step"]
    final = [final_params(root / "job" / f"replica{r}") for r in range(3)]
    assert same_params(final[0], final[1]) and same_params(final[0], final[2])
    ends = [[x for x in read_metrics(root / "job" / f"replica{r}" / "metrics.jsonl") if x["kind"] == "final"][-1]
            for r in range(3)]  # fmt: skip
    assert ends[0]["samples_read"] == ends[1]["samples_read"] == ends[2]["samples_read"] > 0
    # the bytes it records go on across its lives, and adloco plot draws its run (records by trainer)
    totals = [x["bytes_total"] for x in records]
    assert totals == sorted(totals) and totals[len(first_life)] > totals[len(first_life) - 1] > 0
    assert sum(x["bytes"] for x in records) == totals[-1] <= ends[2]["bytes_total"]
    assert {p.name for p in plot_run(root / "job" / "replica2")} == {"loss.png", "batch.png"}


@pytest.mark.process
@needs_torchft
def test_replicas_of_adloco_train_all_killed_go_on_from_their_checkpoints_to_the_plain_runs_bits(tmp_path):
    """Both replicas SIGKILLed a round or two past their checkpoint of round 4 (of 16) and started again with the
    same command: each loads its own checkpoint before its first quorum, neither heals (both are at the same
    step), the rounds after the checkpoint are trained again with their records from before dropped, and both end
    on the plain run's bits."""
    root, deadline = tmp_path / "runs", time.monotonic() + DEADLINE_S
    tokens = 4096  # 16 rounds of 4 steps of 2 workers' 2 samples of 16 tokens
    lighthouse, address = _lighthouse(min_replicas=2)
    try:
        procs = [_replica(root, address, r, 2, tokens, "checkpoint.every=4") for r in (0, 1)]
        while len(_rounds(root, 0)) < 5 and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for proc in procs:
            proc.kill()
        assert _finish(procs, deadline) == [-9, -9]
        first_lives = [_rounds(root, r) for r in (0, 1)]
        saved = [sorted((root / "job" / f"replica{r}" / "checkpoints").glob("round_*.pt")) for r in (0, 1)]
        assert [p.name for p in saved[0]] == [p.name for p in saved[1]] and saved[0]
        resumed_at = int(saved[0][-1].stem.split("_")[1])
        assert resumed_at < max(len(lives) for lives in first_lives) < 16  # rounds past it are trained again
        back = [_replica(root, address, r, 2, tokens, "checkpoint.every=4") for r in (0, 1)]
        assert _finish(back, deadline) == [0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    plain = adloco_process("train", *FAST, "batched_workers=false", f"total_tokens={tokens}",
                           f"run.root={tmp_path / 'plain'}", "run.name=p")  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    expected = final_params(tmp_path / "plain" / "p")
    for r in (0, 1):
        assert same_params(final_params(root / "job" / f"replica{r}"), expected)
        records = _rounds(root, r)
        assert [x["round"] for x in records] == list(range(1, 17))  # once each: the redone rounds' old records gone
        second_life = records[resumed_at]
        assert not second_life["healed"] and second_life["committed"] and "process_seconds" in second_life


def _rounds_saved_by_shard(folder: Path) -> dict[str, set[int]]:
    saved: dict[str, set[int]] = {}
    for path in folder.glob("shard*/round_*.pt"):
        saved.setdefault(path.parent.name, set()).add(int(path.stem.split("_")[1]))
    return saved


def _sharded_replica(root: Path, lighthouse: str, replica: int, tokens: int, *extra: str) -> subprocess.Popen:
    """A replica of a worker sharded over 2 ranks: a torchrun job of its own."""
    items = [*REPLICA, *extra, f"total_tokens={tokens}", f"run.root={root}", "run.name=job", "shards=2"]
    items += [f"fault_tolerance.lighthouse={lighthouse}", f"fault_tolerance.replica={replica}"]
    items += ["fault_tolerance.replicas=2", "workers=2"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=0.1"]
    command += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "adloco", "train", *layered(items)]
    env = {**_env(), "RUST_LOG": "error", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root.parent)  # fmt: skip


@pytest.mark.process
@needs_torchft
def test_replicas_of_sharded_workers_all_killed_go_on_from_every_shards_checkpoint_to_the_plain_runs_theta(tmp_path):
    """2 replicas, each a streaming worker (2 fragments) sharded over the 2 ranks of its own torchrun job, killed
    whole a round past their checkpoint of round 2 (of 8) and started again: each rank loads its own
    checkpoint of the newest round every rank of its replica saved, neither replica heals, and both end on the θ of
    the plain run of the same 2 workers unsharded (up to the order of float additions; without a fault they end on
    the bits of ``adloco train workers=2 shards=2`` under torchrun, checked by hand). The first rank of each replica
    writes its records, the final model whole."""
    root, deadline = tmp_path / "runs", time.monotonic() + DEADLINE_S
    tokens = 2048  # 8 rounds of 4 steps of 2 workers' 2 samples of 16 tokens
    settings = ["method=streaming", "streaming.fragments=2", "streaming.overlap=1", "checkpoint.every=2"]
    lighthouse, address = _lighthouse(min_replicas=2)
    try:
        procs = [_sharded_replica(root, address, r, tokens, *settings) for r in (0, 1)]
        while len(_rounds(root, 0)) < 3 and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for pid in [pid for proc in procs for pid in process_tree(proc.pid)]:  # torchrun and both its ranks
            os.kill(pid, signal.SIGKILL)
        assert _finish(procs, deadline) == [-9, -9]
        saved = [_rounds_saved_by_shard(root / "job" / f"replica{r}" / "checkpoints") for r in (0, 1)]
        assert set(saved[0]) == set(saved[1]) == {"shard0", "shard1"}  # each rank its own
        resumed_at = max(set.intersection(*saved[0].values()))  # the newest round both ranks saved
        assert resumed_at == max(set.intersection(*saved[1].values())) < max(len(_rounds(root, r)) for r in (0, 1))
        back = [_sharded_replica(root, address, r, tokens, *settings) for r in (0, 1)]
        assert _finish(back, deadline) == [0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    # the same 2 workers unsharded, in one process: the same up to the order of float additions (the shards'
    # partial gradients are summed): 2.4e-6 in one run, where a resume that lost the inner optimizer's moments
    # ended 1.7e-2 off
    plain = [*FAST, *settings, "batched_workers=false", f"total_tokens={tokens}", "threads=1"]
    expected = final_params(train(build_config(overrides=[*plain, f"run.root={tmp_path}", "run.name=p"])).run_dir)
    finals = [final_params(root / "job" / f"replica{r}") for r in (0, 1)]
    assert same_params(finals[0], finals[1]) and _within(expected, finals[0], 1e-5)
    assert not same_params(expected, finals[0])  # the comparison has teeth: the sums ran in another order
    for r in (0, 1):
        records = _rounds(root, r)
        assert [x["round"] for x in records] == list(range(1, 9))  # once each: the redone rounds' old records gone
        second_life = records[resumed_at]
        assert not second_life["healed"] and second_life["committed"] and "process_seconds" in second_life


@pytest.mark.process
@needs_torchft
def test_a_replica_whose_checkpoint_is_another_models_stops_with_one_line(tmp_path):
    """Its checkpoint is read before it asks for a quorum: a wrong one is bad input (exit 2), named by folder."""
    folder = tmp_path / "runs" / "job" / "replica0" / "checkpoints"
    folder.mkdir(parents=True)
    state = {"diloco": {}, "model": {"embedding.weight": torch.zeros(3)}, "optimizer": {}}
    save_checkpoint(folder, 4, state, keep=2, kind="replica")
    proc = _replica(tmp_path / "runs", "http://127.0.0.1:9", 0, 2, 2048)  # nothing listens: never reached
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 2, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and "another model's" in err and str(folder) in err


@pytest.mark.process
@needs_torchft
# DiLoCo's rounds: the streaming case's, with fragments; AdLoCo chooses b and H together (on pinned costs)
@pytest.mark.parametrize("method", [["method=adloco", "batch.size=1", "batch.b_cap=8", *PINNED_PACE,
                                     "sync_auto.max=16"],
                                    pytest.param(["method=streaming", "streaming.fragments=2", "streaming.overlap=1",
                                                  "sync_auto.min=4"], marks=pytest.mark.stress)],
                         ids=["adloco", "streaming"])  # fmt: skip
def test_replicas_of_adloco_train_with_sync_every_auto_choose_one_h_that_a_replica_started_again_takes(
    tmp_path, method
):
    """sync_every=auto: H moves from its start on the measured step and exchange times, every replica the same in
    every round (each decides from the round's reports), and the one killed and started again heals with the
    job's H. Streaming: the joiner heals with fragment 0's exchange in flight, which its death dropped; it
    applies it as its peer does (not at all), so their θ never part, and their decisions' figures agree. AdLoCo:
    b and H chosen together on every replica alike (each candidate b weighed at the H the rule would choose)."""
    root, deadline = tmp_path / "runs", time.monotonic() + DEADLINE_S
    # 256 steps of 2 workers' 2 samples of 16 tokens; AdLoCo's b grows to 8: about 8 rounds of H = 16 at the end
    tokens = 32768 if "method=adloco" in method else 16384
    auto = ["sync_every=auto", "sync_auto.start=4", "sync_auto.min=2", "sync_auto.max=64", *method]
    lighthouse, address = _lighthouse(min_replicas=2)  # replica 0 waits for 1 to come back: no split job
    try:
        procs = [_replica(root, address, r, 2, tokens, *auto) for r in (0, 1)]
        while len(_rounds(root, 1)) < 3 and procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[1].kill()
        assert _finish([procs[1]], deadline) == [-9]
        first_life = _rounds(root, 1)
        back = _replica(root, address, 1, 2, tokens, *auto)
        assert _finish([procs[0], back], deadline) == [0, 0]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    h = [{x["round"]: x["sync_every"] for x in _rounds(root, r)} for r in (0, 1)]
    assert {**h[1], **h[0]}[1] == 4 and len(set(h[0].values())) > 1  # H moved from its start
    low, multiple = (4, 2) if "method=streaming" in method else (2, 1)  # streaming: a multiple of its fragments
    assert all(low <= n <= 64 and n % multiple == 0 for n in h[0].values())  # within sync_auto's bounds
    shared = set(h[0]) & set(h[1])
    assert len(shared) > len(first_life) and all(h[0][n] == h[1][n] for n in shared)
    decided = [{x["round"]: x["sync"] for x in _rounds(root, r) if x["committed"]} for r in (0, 1)]
    assert all(decided[0][n] == decided[1][n] for n in set(decided[0]) & set(decided[1]))  # dispersion too
    assert not any(x["diverged"] for r in (0, 1) for x in _rounds(root, r))
    second_life = _rounds(root, 1)[len(first_life) :]
    assert second_life[0]["healed"] and second_life[0]["round"] > first_life[-1]["round"]
    assert same_params(final_params(root / "job" / "replica0"), final_params(root / "job" / "replica1"))
