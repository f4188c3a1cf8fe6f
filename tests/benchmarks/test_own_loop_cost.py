"""benchmarks/own_loop_cost.py: the summary's arithmetic, the table, and --quick end to end (bare, adloco, torchft)."""

import json

import own_loop_cost as bench
import pytest


def _run(step: float, optimizer: float, sync: tuple[float, float], rounds: int = 3, h: int = 2) -> dict:
    """Both ranks' times for ``rounds`` rounds of H = ``h``: every step ``step`` s (``optimizer`` s of it in
    ``optimizer.step()``), a sync step ``sync[rank]`` s more in ``optimizer.step()``."""
    ranks_step, ranks_optimizer = [], []
    for rank in (0, 1):
        steps, opt = [], []
        for i in range(rounds * h):
            extra = sync[rank] if (i + 1) % h == 0 else 0.0
            steps.append(step + extra)
            opt.append(optimizer + extra)
        ranks_step.append(steps)
        ranks_optimizer.append(opt)
    return {"step": ranks_step, "optimizer": ranks_optimizer}


def test_the_summary_counts_a_sync_on_the_rank_that_reached_it_last_and_skips_the_first_round():
    run = _run(0.5, 0.01, (0.3, 0.1))  # rank 0 waited 0.2 s for rank 1, whose exchange took 0.1 s
    run["step"][0][0] = run["optimizer"][0][0] = 9.0  # the warm-up round is not counted
    row = bench.summary([run], 2)
    assert round(row["step_ms"], 6) == 500.0 and round(row["optimizer_ms"], 6) == 10.0
    assert round(row["sync_extra_ms"], 6) == 100.0
    assert row["rounds_counted"] == 2 and row["steps_counted"] == 8
    assert round(row["round_ms"], 6) == 1200.0  # the median of both ranks' rounds: 1.3 s and 1.1 s, two each


def test_the_table_names_a_missing_torchft_instead_of_skipping_it():
    row = {"step_ms": 400.0, "optimizer_ms": 10.0, "sync_extra_ms": 0.0, "round_ms": 4000.0, "hooks_ms": 0.0,
           "hooks_share": 0.0, "round_over_bare": 1.0}  # fmt: skip
    adloco = {**row, "optimizer_ms": 11.0, "hooks_ms": 1.0, "hooks_share": 0.0025, "sync_extra_ms": 80.0,
              "round_cost_share": 0.0225}  # fmt: skip
    report = {
        "date": "2026-01-01",
        "command": "python benchmarks/own_loop_cost.py",
        "versions": {"adloco": "0.1.0", "torchft": "not installed", "torch": "2.13.0", "python": "3.11"},
        "machine": "cpu, 2 cores",
        "shape": bench.FULL,
        "parameters": 3_300_000,
        "repeats": 1,
        "load_average_1min": {"before": 0.1, "after": 2.0},
        "results": {"10": {"steps_per_run": 210, "adloco_vs_torchft_parameters": None,
                           "rows": {"bare": row, "adloco": adloco, "torchft": {"unavailable": "ImportError: x"}}}},
    }  # fmt: skip
    table = bench.render(report)
    assert "| torchft DiLoCo | not run: torchft cannot be imported (ImportError: x) |" in table
    assert "| adloco.DiLoCo | 400.0 | 11.00 | +1.00 ms (+0.25%) | 80 | +2.25% | 1.000× |" in table
    assert "adloco less torchft" not in table


@pytest.mark.process
def test_the_quick_mode_runs_every_side_and_writes_its_results(tmp_path):
    out, doc = tmp_path / "result.json", tmp_path / "doc.md"
    doc.write_text(f"intro\n{bench.MARKERS[0]}\n{bench.MARKERS[1]}\n")
    report = bench.main(["--quick", "--json", str(out), "--write", "--doc", str(doc)])
    assert json.loads(out.read_text())["quick"] is True
    rows = report["results"]["2"]["rows"]
    assert rows["bare"]["round_over_bare"] == 1.0 and rows["adloco"]["step_ms"] > 0
    if report["torchft_unavailable"] is None:
        assert rows["torchft"]["step_ms"] > 0
        assert report["results"]["2"]["adloco_vs_torchft_parameters"]["bit_identical"]  # the same DiLoCo
    else:
        assert "not run: torchft cannot be imported" in doc.read_text()
    assert "| adloco.DiLoCo |" in doc.read_text() and doc.read_text().startswith("intro\n")
