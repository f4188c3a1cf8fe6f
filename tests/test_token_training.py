"""Training on token files: prepare → train → a kill → resume, bit-identical; elastic cursors; a user's loop."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from adloco import DiLoCo
from adloco.checkpoint import list_checkpoints
from adloco.cluster.cluster import Cluster
from adloco.comm.local import LocalCommunicator
from adloco.config import build_config
from adloco.config.input import layered
from adloco.data import TokenWindows
from adloco.data.prepare import PrepareSettings, prepare
from adloco.data.sampling import WindowCursor
from adloco.errors import DataError
from adloco.metrics.writer import read_metrics
from adloco.run.training import tokenizer_and_task, train
from tests.conftest import FAST, PINNED_PACE, adloco_process, final_params, same_params

QUIET = Console(quiet=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The bundled Shakespeare prepared at byte level, in shards of 100k tokens."""
    out = tmp_path_factory.mktemp("tokens") / "shakespeare"
    prepare(PrepareSettings("tinyshakespeare", "byte", shard_tokens=100_000), out, QUIET)
    return out


ADLOCO = ["method=adloco", "batch.b_cap=8", "sync_every=3", "total_tokens=3072", *PINNED_PACE]


@pytest.mark.process
def test_a_killed_run_on_token_files_resumes_bit_identically(corpus, tmp_path):
    overrides = [*FAST, *ADLOCO, f"data.dataset={corpus}", "checkpoint.every=1", "checkpoint.keep=100"]
    full = train(build_config(overrides=[*overrides, f"run.root={tmp_path / 'a'}"]))
    rounds = [r for r in read_metrics(full.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    sizes = [r["batch"]["0"] for r in rounds]
    assert len(set(sizes)) > 1  # b changed between rounds: the samples are grouped differently round to round
    # the same run in a process of its own, killed after a checkpoint drawn at random
    kill_after = int(np.random.default_rng(int(time.time())).integers(1, len(rounds) - 1))
    items = layered([*overrides, f"run.root={tmp_path / 'b'}", "run.name=killed"])
    command = [sys.executable, "-m", "adloco", "train", *items]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    run_dir = tmp_path / "b" / "killed"
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        if (run_dir / "checkpoints").is_dir() and len(list_checkpoints(run_dir / "checkpoints")) >= kill_after:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended before round {kill_after} was checkpointed"
    resumed = adloco_process("train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert same_params(final_params(full.run_dir), final_params(run_dir))
    assert [r["train_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"] == [
        r["train_loss"] for r in rounds
    ]


@pytest.mark.process
def test_the_run_takes_the_prepared_tokenizer_and_refuses_a_changed_folder_on_resume(corpus, tmp_path):
    prepared = tmp_path / "bpe"
    prepare(PrepareSettings("tinyshakespeare", "bpe", vocab_size=300, shard_tokens=50_000), prepared, QUIET)
    overrides = [*FAST, f"data.dataset={prepared}", f"run.root={tmp_path}", "total_tokens=256", "run.name=r"]
    result = train(build_config(overrides=overrides))
    saved = json.loads((result.run_dir / "final" / "adloco_tokenizer.json").read_text())
    assert saved["type"] == "hf" and saved["vocab_size"] == 300
    # the folder prepared anew with another tokenizer: a resume of the run is refused with one line
    import shutil

    shutil.rmtree(prepared)
    prepare(PrepareSettings("tinyshakespeare", "bpe", vocab_size=320, shard_tokens=50_000), prepared, QUIET)
    shutil.rmtree(result.run_dir / "final")
    answer = adloco_process("train", "--resume", str(result.run_dir), "total_tokens=512")
    assert answer.returncode == 2 and "was prepared with another tokenizer than the one this run started" in (
        answer.stderr
    )


@pytest.mark.process
def test_a_model_whose_vocabulary_misses_token_ids_is_refused(tmp_path):
    np.tile(np.arange(300, dtype=np.uint16), 20).tofile(tmp_path / "ids.bin")
    answer = adloco_process("train", f"data.dataset={tmp_path / 'ids.bin'}", *FAST, f"run.root={tmp_path}")
    assert answer.returncode == 2 and "holds token id 299, at or above the vocabulary of tokenizer 'byte'" in (
        answer.stderr
    )


def _cluster(corpus, workers: int) -> Cluster:
    config = build_config(overrides=["model.context=16", "batch.size=3", "batch.memory.b_max=64", "threads=1",
                                     "run.progress=false", f"workers={workers}", "elastic=true",
                                     f"data.dataset={corpus}"])  # fmt: skip
    _, task = tokenizer_and_task(config, None)
    return Cluster(config, task, LocalCommunicator(), torch.device("cpu"))


def test_an_elastic_resize_moves_every_cursor_past_all_reads(corpus):
    four = _cluster(corpus, 4)
    for w, worker in four.workers.items():
        worker.stream.next_batch(5 + (w == 1))  # worker 1 read one more: its row is where the others resume
    saved = four.state_dict()
    three = _cluster(corpus, 3)
    three.load_state_dict(saved)
    assert {w: (s.cursor.base, s.cursor.stride, s.cursor.offset, s.cursor.count)
            for w, s in ((w, k.stream) for w, k in three.workers.items())} == {
        0: (24, 3, 0, 0), 1: (24, 3, 1, 0), 2: (24, 3, 2, 0)}  # fmt: skip
    assert not three.retired_streams
    for worker in three.workers.values():
        worker.stream.next_batch(4)
    back = _cluster(corpus, 4)
    back.load_state_dict(three.state_dict())
    assert [k.stream.cursor.base for k in back.workers.values()] == [36] * 4
    assert [k.stream.cursor.stride for k in back.workers.values()] == [4] * 4
    # what they read next is the run's order from position 36 on, worker w at 36 + w + 4i
    one_reader = WindowCursor(back.workers[0].stream.cursor.order.n, 0, 0, 1)
    expected = one_reader.windows_at(np.arange(36, 44)).reshape(2, 4).T
    for w, worker in back.workers.items():
        assert np.array_equal(worker.stream.cursor.take(2), expected[w])


def test_a_users_loop_reads_the_windows_adloco_train_reads(corpus):
    config = build_config(overrides=["model.context=16", "workers=1", f"data.dataset={corpus}", "seed=3"])
    _, task = tokenizer_and_task(config, None)
    stream = task.stream(12345, worker=0, workers=1)  # the CLI's worker 0 (its own seed does not pick windows)
    windows = TokenWindows(str(corpus), 16)
    model = torch.nn.Linear(2, 2)
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 3})
    sampler = iter(diloco.batch.sampler(windows, seed=3))
    indices = next(sampler)
    inputs, targets = windows.__getitems__(indices)
    expected_inputs, expected_targets = stream.next_batch(len(indices))
    assert torch.equal(inputs, expected_inputs) and torch.equal(targets, expected_targets)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # one shift
    plain = windows.sampler(batch_size=4, worker=1, workers=2, seed=3)
    assert len(next(iter(plain))) == 4 and plain.state_dict()["count"] == 4
    with pytest.raises(DataError):
        TokenWindows(str(corpus / "missing"), 16)


def test_under_several_ranks_the_regroup_pools_what_each_rank_read(corpus, monkeypatch):
    """A rank holds the saved states of its own workers (and the retiring ones); the ends are pooled over the ranks
    before every rank computes the same new base."""
    from adloco.cluster import state as cluster_state

    four = _cluster(corpus, 4)
    for w, worker in four.workers.items():
        worker.stream.next_batch(3 + w)
    saved = {int(w): s for w, s in four.state_dict()["workers"].items()}
    three = _cluster(corpus, 3)
    mine = {w: saved[w] for w in (0, 3)}  # this rank's worker 0 and the retiring worker 3
    theirs = {w: cluster_state.cursor_end(saved[w]["stream"]) for w in (1, 2)}  # the other rank's

    class TwoRanks:
        world_size = 2

        def gather_objects(self, ends):
            return [ends, theirs]

        def broadcast_object(self, obj):
            return obj

    monkeypatch.setattr(three, "comm", TwoRanks())
    cluster_state._regroup_cursors(three, mine)
    assert mine[0]["stream"]["base"] == 4 * (3 + 3) and mine[0]["stream"]["stride"] == 3  # past worker 3's 6 reads
    changed = dict(saved[1]["stream"], windows=5)
    with pytest.raises(DataError, match="the token files have .* windows, the run started on 5"):
        cluster_state._regroup_cursors(three, {1: {"stream": changed}})


def test_token_windows_take_no_unshuffled_order_from_the_adaptive_batch(corpus):
    model = torch.nn.Linear(2, 2)
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, "adloco", batch={"size": 3})
    with pytest.raises(ValueError, match="shuffle=False does not apply"):
        diloco.batch.sampler(TokenWindows(str(corpus), 16), shuffle=False)
