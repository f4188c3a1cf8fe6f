"""benchmarks/sync_schedules.py: the link cell's costs fitted through two fixed H, and a schedule's priced time."""

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("adloco_sync_schedules_benchmark", _BENCHMARKS / "sync_schedules.py")
schedules = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = schedules
_spec.loader.exec_module(schedules)


def _cell(tau, exchange, ranks=2):
    per_step = ranks * schedules.BATCH * schedules.CONTEXT
    runs = {}
    for h, tokens in ((10, 380_000), (50, 430_000), (100, 460_000)):
        exchanges = tokens / (h * per_step)
        seconds = tau * tokens / 1000 + exchange * exchanges
        runs[f"diloco-h{h}"] = [{"time_to_target": seconds, "tokens_to_target": tokens}]
    runs["diloco-h100"].append({"time_to_target": None, "tokens_to_target": None})  # missed: endless
    runs["diloco-h100"].append(dict(runs["diloco-h100"][0]))
    return {"ranks": ranks, "runs": runs}


def test_the_costs_are_fitted_through_the_fixed_h_medians():  # three consistent points: least squares is exact
    tau, exchange = schedules.fitted_costs(_cell(0.076, 0.52))
    assert tau == pytest.approx(0.076) and exchange == pytest.approx(0.52)
    tau, exchange = schedules.fitted_costs(_cell(0.1, 1.3, ranks=4))
    assert tau == pytest.approx(0.1) and exchange == pytest.approx(1.3)
    cell = _cell(0.1, 1.3)
    cell["runs"]["diloco-h50"][0]["time_to_target"] += 3.0  # off the line: the fit moves, but stays between
    tau, exchange = schedules.fitted_costs(cell)
    assert tau != pytest.approx(0.1) and 0.05 < tau < 0.15
    for h in (50, 100):
        cell["runs"][f"diloco-h{h}"] = [{"time_to_target": None, "tokens_to_target": None}]
    with pytest.raises(SystemExit, match="fewer than two fixed H"):
        schedules.fitted_costs(cell)


def _round(tokens, loss, h=50):
    return {"kind": "round", "tokens": tokens, "seconds": tokens / 1000, "val_loss": {"0": loss}, "sync_every": h}


def test_a_schedule_is_priced_by_its_tokens_and_the_exchanges_up_to_the_crossing():
    rounds = [_round(100_000, 2.2, 10), _round(200_000, 2.0, 80), _round(300_000, 1.9, 90), _round(400_000, 1.8)]
    priced = schedules.summary(rounds, 1.95, tau=0.1, exchange=0.5)
    assert priced["tokens"] == 250_000  # half-way between the evaluations around 1.95
    assert priced["exchanges"] == 3  # the round whose evaluation crossed it exchanged too
    assert priced["seconds"] == pytest.approx(0.1 * 250 + 0.5 * 3)
    assert priced["h"] == [10, 80, 90, 50]
    missed = schedules.summary(rounds, 1.5, tau=0.1, exchange=0.5)
    assert missed["tokens"] is None and missed["seconds"] is None


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--schedules", "nope"], ["--schedules", ","], ["--seeds", "a"], ["--link-results", "/nonexistent"]):
        with pytest.raises(SystemExit) as stop:
            schedules.main(argv)
        assert stop.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
