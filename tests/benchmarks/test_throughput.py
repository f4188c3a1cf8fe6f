"""benchmarks/throughput.py: what it runs, how it times a run, and what it reports."""

import json

import throughput

from adloco import build_config


def test_every_cell_compares_one_worker_with_the_same_batch_one_by_one_and_stacked():
    cells = throughput.cells(["tiny", "small"], [4, 8])
    assert list(cells) == ["tiny × 4", "tiny × 8", "small × 4", "small × 8"]
    for runs in cells.values():
        configs = {label: build_config(overrides=overrides) for label, overrides in runs.items()}
        one, alone, stacked = configs["one worker"], configs["one by one"], configs["stacked"]
        assert one.total_workers == 1 and one.batch.size == alone.batch.size * alone.total_workers
        assert (alone.batched_workers, stacked.batched_workers) == (False, True)
        assert one.total_tokens == alone.total_tokens == stacked.total_tokens
        assert one.model == alone.model == stacked.model


def test_a_run_is_timed_without_its_first_and_last_rounds(tmp_path):
    records = [{"kind": "step"}] + [
        {"kind": "round", "tokens": 100 * (i + 1), "round_seconds": seconds}
        for i, seconds in enumerate((9.0, 1.0, 3.0, 9.0))
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    assert throughput.steady_tokens_per_second(metrics) == 200 / 4.0


def test_the_report_marks_the_target_from_medians():
    rates = {
        "tiny × 4": {"one worker": [100, 90, 110], "one by one": [60, 50, 70], "stacked": [95, 5, 91]},
        "tiny × 8": {"one worker": [100, 100, 100], "one by one": [60, 60, 60], "stacked": [80, 85, 89]},
    }
    environment = {"date": "d", "adloco": "0", "torch": "2", "python": "3", "machine": "m"}
    result = {"environment": environment, "repeats": 3, "rates": rates}
    text = "\n".join(throughput.markdown(result))
    assert "| tiny × 4 | 100 | 60 | 91 | **0.91** (met) | 1.52 |" in text
    assert "| tiny × 8 | 100 | 60 | 85 | **0.85** (not met) | 1.42 |" in text
