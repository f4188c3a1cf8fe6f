"""benchmarks/slow_rank.py: round figures, the rank placement, and a real CPU quota that slows a process."""

import subprocess
import sys

import pytest
import slow_rank


def _round(index, seconds, wait, exchanges):
    rank = {"wait_seconds": wait, "exchanges": exchanges}
    return {"kind": "round", "round": index, "steps": 10, "round_seconds": seconds, "tokens_per_second": 100.0,
            "ranks": [rank, {"wait_seconds": 0.0, "exchanges": exchanges}]}  # fmt: skip


def test_round_figures_are_rank_zeros_medians_after_the_warm_up_round():
    records = [_round(0, 9.0, 5.0, 3), _round(1, 2.0, 1.0, 1), _round(2, 2.2, 1.2, 1), _round(3, 4.0, 3.0, 1)]
    records[-1]["samples"] = {"0": 4, "1": 2}
    final = {"kind": "final", "seconds": 17.5, "val_loss": {"0": 2.5}}
    figures = slow_rank.round_figures([{"kind": "step"}, *records, final])
    assert figures["rounds"] == 3 and figures["round_seconds"] == 2.2 and figures["wait_seconds"] == 1.2
    assert figures["exchanges"] == 1 and figures["steps_per_round"] == 10
    assert figures["train_seconds"] == 17.5 and figures["final_val_loss"] == 2.5
    assert figures["samples"] == {"0": 4, "1": 2}
    with pytest.raises(slow_rank.LinkError, match="no round record after the warm-up, or no final"):
        slow_rank.round_figures([*records[:1], final])
    with pytest.raises(slow_rank.LinkError, match="no final record"):
        slow_rank.round_figures(records)


def test_each_rank_is_pinned_and_only_the_slow_one_joins_the_group(tmp_path):
    placement = slow_rank.Loopback(cores=(0, 1), groups=(None, tmp_path / "cgroup.procs"))
    assert placement.exec_prefix(0) == ["taskset", "-c", "0"]
    prefix = placement.exec_prefix(1)
    assert prefix[:2] == ["sh", "-c"] and prefix[3] == str(tmp_path / "cgroup.procs") and prefix[-3:] == [
        "taskset", "-c", "1",
    ]  # fmt: skip
    assert placement.addresses == ("127.0.0.1", "127.0.0.1") and placement.interfaces == ("lo", "lo")


def test_the_table_shows_the_wait_per_exchange_the_split_and_the_loss(tmp_path):
    row = {"method": "ddp", "fraction": 0.4, "round_seconds": 2.0, "wait_seconds": 1.0, "exchanges": 10,
           "samples": None, "train_seconds": 30.04, "final_val_loss": 2.71828}  # fmt: skip
    shared = {**row, "method": "diloco-speed-shares", "exchanges": 1, "samples": {"1": 2, "0": 4}}
    report = {"date": "d", "command": "c", "machine": "m", "sync_every": 10, "rows": [row, shared],
              "versions": {"adloco": "a", "torch": "t", "python": "p"}}  # fmt: skip
    table = slow_rank.markdown(report)
    assert "| ddp | 40% of a core | 2.00 | 1.00 s | 10 | 100 ms | equal | 30.0 | 2.7183 |" in table
    assert "| diloco-speed-shares | 40% of a core | 2.00 | 1.00 s | 1 | 1000 ms | 4, 2 | 30.0 | 2.7183 |" in table


_UNAVAILABLE = slow_rank.unavailable()


@pytest.mark.process
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"slow rank unavailable: {_UNAVAILABLE}")
def test_a_process_in_the_quota_group_gets_only_its_share_of_a_core():
    busy = (
        "import time; start = time.monotonic(); c0 = time.process_time()\n"
        "while time.monotonic() - start < 1.0: pass\n"
        "print(time.process_time() - c0)"
    )
    with slow_rank.cpu_quota(0.25, name="adloco-test-quota") as procs:
        prefix = slow_rank.Loopback(cores=(0, 1), groups=(None, procs)).exec_prefix(1)
        done = subprocess.run([*prefix, sys.executable, "-c", busy], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    used = float(done.stdout)
    assert 0.1 < used < 0.4  # a quarter of one second of wall time, give or take the quota's 100 ms periods
    assert not (procs.parent).exists()  # the group is removed afterwards
