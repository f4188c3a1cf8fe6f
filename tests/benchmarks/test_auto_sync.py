"""benchmarks/auto_sync.py: the verdicts' figures, medians over seeds and the dispersion summary of a cell."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("adloco_auto_sync_benchmark", _BENCHMARKS / "auto_sync.py")
auto_sync = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = auto_sync
_spec.loader.exec_module(auto_sync)


def _run(seconds, tokens, seed, h=50, dispersion=()):
    return {"time_to_target": seconds, "tokens_to_target": tokens, "seed": seed, "h": [h], "bytes": 1e6,
            "dispersion": list(dispersion)}  # fmt: skip


def test_a_ratio_that_rounds_onto_a_bound_gets_the_digits_that_tell_its_side():
    assert auto_sync.ratio_text(1.1014, 1.1) == "1.101×"  # "1.10×" would read as meeting ≤ 1.1
    assert auto_sync.ratio_text(0.9003, 0.9, 1.1) == "0.9003×"  # against each bound it is given
    assert auto_sync.ratio_text(1.0996, 1.1) == "1.0996×"  # on the meeting side too: "1.10×" is ambiguous
    assert auto_sync.ratio_text(1.1, 1.1) == "1.10×"  # on the bound itself, two decimals say it
    assert auto_sync.ratio_text(1.0432, 1.1, 0.95) == "1.04×"


def test_a_run_that_missed_the_target_counts_as_endless_in_tokens_as_in_time():
    runs = [_run(40.0, 500_000, 0), _run(None, None, 1), _run(42.0, 520_000, 2)]
    assert auto_sync.median_time(runs) == 42.0
    assert auto_sync.tokens_text(runs) == "520,000 (500k, —, 520k)"
    assert auto_sync.tokens_text([_run(None, None, 0)]) == "—"


def test_the_table_names_the_seeds_its_runs_took():
    cell = {"runs": {"ddp": [{"h": [10]}], "diloco-h50": [_run(1.0, 1, 0), _run(1.0, 1, 1), _run(1.0, 1, 2)]}}
    assert auto_sync.seeds_of(cell) == "seeds 0, 1, 2"
    assert auto_sync.seeds_of({"runs": {"ddp": [{"h": [10]}]}}) == "seed 0"


def test_dispersion_is_summarised_per_fixed_h_over_the_second_half_of_each_run():
    runs = {
        "diloco-h10": [_run(1.0, 1, 0, 10, [9.0, 9.0, 0.4, 0.5])],  # the early rounds are left out
        "diloco-h100": [_run(1.0, 1, 0, 100, [9.0, 0.3]), _run(1.0, 1, 1, 100, [9.0, None, 0.2])],
        "diloco-auto": [_run(1.0, 1, 0, 90, [0.1, 0.1])],
    }
    assert auto_sync.late_dispersion(runs) == {"diloco-h10": 0.45, "diloco-h100": 0.25}


def test_the_best_fixed_h_is_the_least_median_over_seeds_not_the_luckiest_run():
    runs = {"diloco-h50": [_run(40.0, 1, 0), _run(44.0, 1, 1), _run(45.0, 1, 2)],
            "diloco-h100": [_run(35.0, 1, 0), _run(46.0, 1, 1), _run(47.0, 1, 2)]}  # fmt: skip
    assert auto_sync.best_fixed(runs, "fp32") == ("diloco-h50", 44.0)


def test_the_swept_h_is_picked_without_the_seed_it_is_timed_at():
    runs = {"diloco-h50": [_run(40.0, 1, 0), _run(44.0, 1, 1), _run(45.0, 1, 2)],
            "diloco-h100": [_run(30.0, 1, 0), _run(46.0, 1, 1), _run(47.0, 1, 2)],
            "diloco-h10": [_run(10.0, 1, 0)],  # not run at every seed: not in the sweep
            "diloco-auto": [_run(41.0, 1, 0), _run(42.0, 1, 1), _run(43.0, 1, 2)]}  # fmt: skip
    # seed 0 held out: H = 50 wins on seeds 1, 2 and takes 40 there; seed 1: H = 100 (30, 47 → 38.5) takes 46;
    # seed 2: H = 100 (30, 46 → 38) takes 47; the median of 40, 46, 47
    assert auto_sync.swept_fixed(runs, "fp32") == 46.0
    cell = {"runs": runs}
    lines = auto_sync.verdicts({"cells": {"c": cell}})
    assert "against a sweep's pick 0.91×" in lines[0]  # 42 against 46
    swept = next(line for line in lines if "sweep picks" in line)
    assert "auto 0.91×, AdLoCo — over 0" in swept  # this cell ran no AdLoCo: not counted as missing the target
    # a miss counts as endless: with H = 100 missing at seed 2, the folds pick H = 50 (40), H = 50 (44), and
    # H = 100 (30, 46 → 38 beats 42) which never reaches the target at seed 2
    runs["diloco-h100"][2]["time_to_target"] = None
    assert auto_sync.swept_fixed(runs, "fp32") == 44.0
    assert (
        auto_sync.swept_fixed({"diloco-h50": runs["diloco-h50"], "diloco-auto": runs["diloco-auto"][:1]}, "fp32")
        is None
    )  # one seed: nothing to hold out


def test_a_sweep_whose_picks_miss_the_target_is_said_so_and_left_out_of_the_median():
    runs = {"diloco-h50": [_run(None, None, 0), _run(None, None, 1)],
            "diloco-h100": [_run(30.0, 1, 0), _run(None, None, 1), _run(90.0, 1, 1)],  # seed 1 twice: its median
            "diloco-auto": [_run(41.0, 1, 0), _run(42.0, 1, 1)]}  # fmt: skip
    # seed 0 held out: H = 100's seed 1 is the median of endless and 90 (endless) and H = 50's endless: the first
    # of the tie, H = 50, misses at seed 0; seed 1 held out: H = 100 (30) misses at seed 1
    assert auto_sync.swept_fixed(runs, "fp32") == math.inf
    lines = auto_sync.verdicts({"cells": {"c": {"runs": runs}}})
    assert "a sweep's pick did not reach the target" in lines[0]
    assert not any("sweep picks" in line for line in lines)


def test_a_fixed_h_outside_the_grid_is_reported_beside_the_verdict_but_never_judged_as_its_best():
    runs = {"diloco-h100": [_run(64.0, 1, 0), _run(60.0, 1, 1), _run(72.0, 1, 2)],
            "diloco-h200": [_run(55.0, 1, 0), _run(52.0, 1, 1), _run(None, None, 2)],
            "diloco-fp4-h400": [_run(10.0, 1, 0)],  # another codec: not this one's
            "diloco-auto": [_run(56.0, 1, 0), _run(56.0, 1, 1), _run(69.0, 1, 2)]}  # fmt: skip
    assert auto_sync.best_fixed(runs, "fp32") == ("diloco-h100", 64.0)
    assert auto_sync.beyond_grid(runs, "fp32") == ("diloco-h200", 55.0)  # the miss at seed 2 counts as endless
    line = auto_sync.verdicts({"cells": {"c": {"runs": runs}}})[0]
    assert "best fixed H (diloco-h100) 0.88×: **met**" in line  # 56 against 64; H = 200 not the grid's
    assert line.endswith("against diloco-h200 (outside the grid, 55.0 s; no target) auto 1.02×")
    assert auto_sync.beyond_grid(runs, "fp4") == ("diloco-fp4-h400", 10.0)
    runs["diloco-h200"][0]["time_to_target"] = None  # two misses of three: its median is endless, and said so
    assert auto_sync.beyond_grid(runs, "fp32") == ("diloco-h200", math.inf)
    line = auto_sync.verdicts({"cells": {"c": {"runs": runs}}})[0]
    assert line.endswith("; diloco-h200 (outside the grid) did not reach the target")
    del runs["diloco-h200"]
    assert auto_sync.beyond_grid(runs, "fp32") == (None, None)
    assert "outside the grid" not in auto_sync.verdicts({"cells": {"c": {"runs": runs}}})[0]


def test_a_lifted_bound_runs_auto_under_a_name_of_its_own_and_leaves_the_verdicts_to_auto():
    assert auto_sync.method_overrides("diloco-auto-max1000", 2) == [
        "method=diloco", "workers=2", "sync_every=auto", "sync_auto.max=1000"]  # fmt: skip
    assert auto_sync.method_overrides("adloco-fp4-auto-max500", 4)[-3:] == [
        "sync_every=auto", "codec.name=fp4-e2m1", "sync_auto.max=500"]  # fmt: skip
    runs = {"diloco-h100": [_run(64.0, 1, 0)], "diloco-auto": [_run(56.0, 1, 0)],
            "diloco-auto-max1000": [_run(30.0, 1, 0)]}  # fmt: skip
    (check,) = auto_sync.cell_checks("c", {"runs": runs})
    assert check["auto_seconds"] == 56.0 and check["beyond"] is None
    for name in ("diloco-auto-max", "diloco-fp4-auto-max", "diloco-auto-maxabc", "diloco-auto-max1000-fp4",
                 "ddp-auto-max5"):  # fmt: skip
        with pytest.raises(ValueError, match="-auto-max takes a number"):
            auto_sync.method_overrides(name, 2)
    with pytest.raises(SystemExit) as refused:  # refused before any link is built
        auto_sync.main(["--cells", "2:20", "--methods", "diloco-auto,diloco-auto-max"])
    assert refused.value.code == 2
