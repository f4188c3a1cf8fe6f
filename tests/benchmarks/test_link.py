"""benchmarks/link.py: time-to-target parsing, targets, doc writing, and real jobs over a limited namespace link."""

import importlib.util
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from adloco import build_config, train

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "link.py"
_spec = importlib.util.spec_from_file_location("adloco_link_benchmark", _PATH)
link = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = link  # dataclasses look their module up by name
_spec.loader.exec_module(link)


def _round(seconds, tokens, val, eval_seconds=0.0):
    return {
        "kind": "round",
        "seconds": seconds,
        "tokens": tokens,
        "val_loss": val,
        "eval_seconds": eval_seconds,
        "bytes_total": tokens // 10,
        "comm_seconds": 0.5,
    }


RECORDS = [
    _round(1.0, 100, {"0": 3.0}, eval_seconds=0.25),
    _round(2.0, 200, None),  # not an evaluation round
    _round(3.0, 300, {"0": 2.5, "1": 2.05}, eval_seconds=0.25),  # the best trainer counts
    _round(4.0, 400, {"0": 1.9}, eval_seconds=0.5),
    {"kind": "final", "val_loss": {"0": 1.9, "1": 2.4}, "seconds": 4.5, "tokens": 400, "bytes_total": 40},
]


def test_time_to_target_is_training_time_at_the_first_evaluation_at_or_below_the_target():
    # The clock minus every evaluation so far, the one that reached the target included.
    assert link.time_to_target(RECORDS, 2.05) == (2.5, 300)
    assert link.time_to_target(RECORDS, 2.0) == (3.0, 400)
    assert link.time_to_target(RECORDS, 3.0) == (0.75, 100)
    assert link.time_to_target(RECORDS, 1.0) is None
    assert link.final_val_loss(RECORDS) == 1.9


def test_summary_of_a_finished_and_of_a_stopped_run():
    summary = link.summarise(RECORDS, target=2.2)
    assert summary["finished"] and summary["time_to_target"] == 2.5 and summary["tokens_to_target"] == 300
    assert summary["val_loss"] == 1.9 and summary["bytes"] == 40 and summary["seconds"] == 3.0
    assert summary["comm_seconds"] == 2.0 and summary["eval_seconds"] == 1.0
    stopped = link.summarise(RECORDS[:3], target=2.2)  # killed once the third round reached the target
    assert not stopped["finished"] and stopped["val_loss"] == 2.05 and stopped["tokens"] == 300
    with pytest.raises(link.LinkError, match="no final record"):
        link.final_val_loss(RECORDS[:-1])
    with pytest.raises(link.LinkError, match="no round record"):
        link.summarise([], target=1.0)


def test_metrics_tail_leaves_a_half_written_line_for_later(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = link.MetricsTail(path)
    assert tail.poll() == []  # not created yet
    first, step = json.dumps(RECORDS[0]), json.dumps({"kind": "step", "loss": {"0": 1.0}})
    path.write_text(first + "\n" + step + "\n" + first[:10])
    assert tail.poll() == [RECORDS[0]]  # the step record is dropped, the partial line waits
    path.write_text(first + "\n" + step + "\n" + first + "\n")
    assert tail.poll() == [RECORDS[0], RECORDS[0]]


def test_burst_grows_with_the_rate_above_100_mbit():
    assert link.burst_for(100) == "32kbit"
    assert link.burst_for(1000) == "1000kbit"


def _result(time_to_target):
    return {"time_to_target": time_to_target}


def test_targets_are_met_or_not_with_the_figure():
    results = {"ddp": _result(100.0), "diloco": _result(20.0), "adloco": _result(8.0), "streaming": _result(None)}
    checks = {c["method"]: c for c in link.target_checks(results)}
    assert set(checks) == {"diloco", "adloco", "streaming"}
    assert (
        checks["diloco"]["vs_ddp"] == 5.0 and not checks["diloco"]["vs_ddp_met"] and "vs_diloco" not in checks["diloco"]
    )
    assert checks["adloco"]["vs_ddp"] == 12.5 and checks["adloco"]["vs_ddp_met"]
    assert checks["adloco"]["vs_diloco"] == 2.5 and checks["adloco"]["vs_diloco_met"]
    assert checks["streaming"]["vs_ddp"] is None and not checks["streaming"]["vs_ddp_met"]
    text = link.targets_text(list(checks.values()))
    assert "- adloco: ≥ 10× vs DDP: **met** (12.50×); ≥ 1.3× vs DiLoCo: **met** (2.50×)" in text
    assert "- diloco: ≥ 10× vs DDP: **not met** (5.00×)" in text
    assert "streaming: ≥ 10× vs DDP: **not met** (target not reached)" in text
    assert "Not measured" in link.targets_text(None)


def test_links_are_rate_at_round_trip_pairs():
    assert link.parse_links("100@0, 1000@50") == [(100, 0.0), (1000, 50.0)]
    for bad in ("100", "fast@50", "100@-1", "0@50"):
        with pytest.raises(ValueError, match="--links wants RATE@RTT"):
            link.parse_links(bad)


def _latency_run(ranks, rate, rtt, diloco_seconds):
    results = {"ddp": _result(500.0), "diloco": _result(diloco_seconds)}
    return {"ranks": ranks, "rate_mbit": rate, "rtt_ms": rtt, "results": results}


def test_latency_target_compares_diloco_with_the_same_rate_and_ranks_at_zero_delay():
    runs = [
        _latency_run(2, 100, 0, 40.0),
        _latency_run(2, 100, 50, 44.0),  # 1.10x: met
        _latency_run(4, 100, 0, 40.0),
        _latency_run(4, 100, 50, 48.0),  # 1.20x: not met
        _latency_run(2, 1000, 50, 30.0),  # no ~0 ms run at 1 Gbit/s to compare with
        _latency_run(2, 10, 0, None),
        _latency_run(2, 10, 50, 30.0),  # the ~0 ms run never reached the target
    ]
    checks = link.latency_checks(runs)
    assert [(c["ranks"], c["rate_mbit"], c["met"]) for c in checks] == [(2, 100, True), (4, 100, False), (2, 10, False)]
    assert checks[0]["ratio"] == pytest.approx(1.1) and checks[2]["ratio"] is None


def test_bad_links_and_rank_lists_are_one_line_errors(capsys):
    for argv in (["--links", "100@x"], ["--ranks", "2,4"], ["--ranks", "two"], ["--links", "100@0", "--ranks", "2,9"]):
        with pytest.raises(SystemExit) as exit_info:
            link.main(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--links wants RATE@RTT" in err and "a list only with --links" in err and "--ranks wants integers" in err


def test_write_between_replaces_only_the_marked_part(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{link.BEGIN}\nold table\n{link.END}\nafter\n")
    link.write_between(doc, link.BEGIN, link.END, "new table\n")
    assert doc.read_text() == f"before\n{link.BEGIN}\nnew table\n{link.END}\nafter\n"
    doc.write_text("no markers\n")
    with pytest.raises(link.LinkError, match="no <!-- link:begin -->"):
        link.write_between(doc, link.BEGIN, link.END, "x")


def test_without_root_the_benchmark_says_why_and_skips(monkeypatch, capsys):
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    assert link.netns_unavailable() == "creating network namespaces needs root"
    assert link.main(["--rates", "100"]) == 0
    assert capsys.readouterr().out.strip() == "skipped: creating network namespaces needs root"


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--rates", "fast"], ["--methods", "ddp,warp"], ["--ranks", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            link.main(argv)
        assert exit_info.value.code == 2
    assert "unknown method 'warp'" in capsys.readouterr().err


def test_the_final_evaluation_on_fixed_blocks_equals_the_last_periodic_one(tmp_path):
    # The benchmark compares DDP's final loss with the others' periodic ones: both must use the same blocks.
    overrides = ["model.context=16", "batch.size=2", "sync_every=2", "total_tokens=256", "inner.warmup_steps=1"]
    overrides += ["workers=2", "eval.every=1", "eval.blocks=4", "eval.final_full=false", "run.progress=false"]
    overrides += ["run.plots=false", "run.save_final=false", "run.trackers=[]", f"run.root={tmp_path}", "run.name=r"]
    train(build_config(overrides=overrides))
    records = link._read(tmp_path / "r" / "metrics.jsonl")
    last = [loss for _, _, loss in link.evaluations(records)][-1]
    assert link.final_val_loss(records) == last
    assert all(r["eval_seconds"] > 0 for r in records if r["kind"] == "round")  # every round evaluated


_UNAVAILABLE = link.netns_unavailable()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.process
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"namespace link unavailable: {_UNAVAILABLE}")
def test_three_ranks_on_one_bridge_and_cleanup_even_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"), link.namespace_link(100, ranks=3, prefix="adlt1") as made:
        assert {"adlt1ns0", "adlt1ns1", "adlt1ns2", "adlt1hub"} <= set(_namespaces().split())
        # Through the bridge: rank 2's upload and rank 0's download both carry the 100 Mbit/s bucket.
        assert 20 < link.measure_rate(made, megabytes=2, src=2, dst=0) < 105
        raise RuntimeError("boom")
    assert "adlt1" not in _namespaces()


@pytest.mark.process
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"namespace link unavailable: {_UNAVAILABLE}")
def test_a_two_rank_job_over_a_100_mbit_link_stopped_at_its_first_evaluation(tmp_path):
    overrides = [
        "method=diloco",
        "model.context=16",
        "batch.size=2",
        "sync_every=2",
        "total_tokens=2048",  # 16 rounds: far more than the job is allowed to run
        "inner.warmup_steps=1",
        "eval.blocks=4",
        f"run.root={tmp_path}",
        "run.name=job",
    ]
    tail = link.MetricsTail(tmp_path / "job" / "metrics.jsonl")
    with link.namespace_link(100, prefix="adlt2") as made:
        rate = link.measure_rate(made, megabytes=2)
        # tbf enforces the ceiling; the floor only guards against a link that barely works.
        assert 20 < rate < 105
        args = [*link.COMMON, *link.method_overrides("diloco", 2), *overrides, "eval.every=1"]
        stopped = link.launch_job(made, args, timeout_s=240, logs=tmp_path, stop=lambda: bool(tail.poll()))
    assert stopped and "adlt2" not in _namespaces()
    records = tail.poll()
    rounds = [r for r in records if r["kind"] == "round"]
    assert 1 <= len(rounds) < 16 and not any(r["kind"] == "final" for r in records)
    assert rounds[0]["ranks"][1]["wire_bytes"] > 0  # rank 1 did talk, across the link
    summary = link.summarise(records, target=100.0)
    assert not summary["finished"] and summary["time_to_target"] == pytest.approx(
        rounds[0]["seconds"] - rounds[0]["eval_seconds"]
    )
    assert (tmp_path / "rank0.log").exists() and (tmp_path / "rank1.log").exists()


def _adaptive_result(time_to_target):
    tokens = None if time_to_target is None else 1000
    return {"time_to_target": time_to_target, "tokens_to_target": tokens, "tokens": 2000, "val_loss": 2.0,
            "seconds": 70.0, "comm_seconds": 5.0, "exchanges": 7, "bytes": 1e6}  # fmt: skip


def _adaptive_run(ranks, rate, times):
    results = {m: _adaptive_result(t) for m, t in times.items()}
    return {"ranks": ranks, "rate_mbit": rate, "measured_mbit": rate * 0.95, "results": results}


def test_adaptive_target_takes_the_fastest_adloco_and_diloco_with_the_same_codec():
    runs = [
        _adaptive_run(2, 100, {"diloco-h10": 60.0, "diloco-h20": 50.0, "diloco-h50": None, "adloco-1t": 36.0,
                               "adloco-1t-h50": 30.0, "diloco-fp4-h10": 40.0, "diloco-fp4-h20": 45.0,
                               "adloco-1t-fp4": 28.0}),
        _adaptive_run(4, 1000, {"diloco-h10": None, "diloco-h20": None, "adloco-1t": 10.0, "adloco-1t-fp4": None}),
    ]  # fmt: skip
    checks = link.adaptive_checks(runs)
    fp32, fp4, no_diloco, none_reached = checks
    assert (fp32["adloco"], fp32["diloco"], fp32["ratio"], fp32["met"]) == ("adloco-1t-h50", "diloco-h20", 0.6, True)
    assert (fp4["adloco"], fp4["diloco"], fp4["ratio"], fp4["met"]) == ("adloco-1t-fp4", "diloco-fp4-h10", 0.7, False)
    assert no_diloco["diloco"] is None and no_diloco["ratio"] is None and not no_diloco["met"]
    assert none_reached["codec"] == "fp4" and none_reached["adloco"] is None and not none_reached["met"]
    versions = {"adloco": "0", "torch": "t", "python": "p"}
    report = {"date": "d", "command": "c", "versions": versions, "machine": "m", "seed": 0, "ddp_tokens": 10,
              "other_tokens": 20, "runs": runs, "checks": checks}  # fmt: skip
    text = link.adaptive_markdown(report)
    assert "- 2 ranks, 100 Mbit/s, fp32: **met** (adloco-1t-h50 30.0 s against diloco-h20 50.0 s: 0.60×)" in text
    assert "- 2 ranks, 100 Mbit/s, fp4: **not met** (adloco-1t-fp4 28.0 s against diloco-fp4-h10 40.0 s: 0.70×)" in text
    assert "- 4 ranks, 1000 Mbit/s, fp32: **not met** (adloco-1t 10.0 s; no DiLoCo run reached the target)" in text
    assert "- 4 ranks, 1000 Mbit/s, fp4: **not met** (AdLoCo did not reach the target)" in text
    assert "| adloco-1t | 2,000 | 2.0000 | 70.0 | 5.0 | 7 | 1.0 MB | 36.0 s | 1,000 | — | 1.67× |" in text


def test_every_adaptive_method_has_its_overrides():
    for method in link.ADAPTIVE_METHODS:
        overrides = link.method_overrides(method, 4)
        assert "workers=4" in overrides
        build_config(overrides=overrides)  # each is a valid configuration
    assert "sync_every=50" in link.method_overrides("diloco-fp4-h50", 2)
    assert "codec.name=fp4-e2m1" in link.method_overrides("adloco-1t-fp4", 2)
    assert link.method_overrides("adloco-1t-h50", 2)[-1] == "sync_every=50"


def test_each_comparison_has_its_own_results_file_and_doc_section():
    assert link.outputs(False, False, None) == (link.RESULTS, (link.BEGIN, link.END))
    assert link.outputs(False, True, None)[0].name == "latency.json"
    json_path, markers = link.outputs(True, True, "python")
    assert json_path.name == "link_adloco_latency_python.json"
    assert markers == ("<!-- link-adloco-latency-python:begin -->", "<!-- link-adloco-latency-python:end -->")
    assert link.outputs(True, False, None)[1][0] == "<!-- link-adloco:begin -->"


def test_adaptive_over_the_delay_line_writes_to_its_own_section(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"{link.BEGIN}\n{link.END}\n")  # the tbf section only
    with pytest.raises(SystemExit) as exit_info:
        link.main(["--adaptive", "--links", "100@50", "--write", "--doc", str(doc)])
    assert exit_info.value.code == 2
    assert "has no <!-- link-adloco-latency:begin -->" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        link.main(["--adaptive", "--corpus", "shakespeare"])
    assert "invalid choice: 'shakespeare'" in capsys.readouterr().err


def test_adaptive_tables_and_checks_name_the_round_trip_on_the_delay_line():
    delayed = _adaptive_run(2, 100, {"diloco-h10": 50.0, "adloco-1t": 30.0})
    delayed.update(rtt_ms=50.0, measured_rtt_ms=51.2)
    checks = link.adaptive_checks([delayed])
    assert checks[0]["rtt_ms"] == 50.0 and checks[0]["met"]
    versions = {"adloco": "0", "torch": "t", "python": "p"}
    corpus = {"corpus": "Python standard library .py sources", "python": "3.11.7", "files": 1758,
              "characters": 31_500_000}  # fmt: skip
    report = {"date": "d", "command": "c", "versions": versions, "machine": "m", "seed": 0, "ddp_tokens": 10,
              "other_tokens": 20, "runs": [delayed], "checks": checks, "corpus": corpus}  # fmt: skip
    text = link.adaptive_markdown(report)
    assert "**2 ranks, 100 Mbit/s, 50 ms RTT (measured 95 Mbit/s and 51.2 ms rank 0 → rank 1)**" in text
    assert "- 2 ranks, 100 Mbit/s, 50 ms RTT, fp32: **met** (adloco-1t 30.0 s against diloco-h10 50.0 s: 0.60×)" in text
    assert "Every link is the delay line. Corpus: Python standard library .py sources of Python 3.11.7" in text


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["--adaptive", "--links", "100@50"], "adaptive-delay"),
        (["--adaptive", "--rates", "100"], "adaptive-tbf"),
        (["--links", "100@0"], "latency"),
        (["--rates", "100"], "tbf"),
    ],
)
def test_each_mode_runs_its_methods_on_its_links_and_writes_its_own_file(monkeypatch, tmp_path, argv, kind):
    opened = []

    @contextmanager
    def fake_link(ranks, rate, rtt):
        opened.append((ranks, rate, rtt))
        run = {"ranks": ranks, "rate_mbit": rate, "rtt_ms": rtt, "measured_mbit": rate * 0.9}
        if rtt is not None:
            run.update(measured_rtt_ms=rtt + 0.5, burst_ms={"slow_start": 400.0, "kept_window": 100.0})
        yield object(), run

    def fake_rate(link_, args, root):
        results = {m: _adaptive_result(10.0) for m in args.methods}
        results["ddp"]["val_loss"] = 2.0
        return results

    monkeypatch.setattr(link, "netns_unavailable", lambda: None)
    monkeypatch.setattr(link, "measured_link", fake_link)
    monkeypatch.setattr(link, "run_rate", fake_rate)
    out = tmp_path / "results.json"
    assert link.main([*argv, "--json", str(out), "--out", str(tmp_path / "runs")]) == 0
    report = json.loads(out.read_text())
    rtt = 50.0 if kind == "adaptive-delay" else 0.0 if kind == "latency" else None
    assert opened == [(2, 100, rtt)]
    assert ("tbf" in report) == (rtt is None)
    if kind.startswith("adaptive"):
        assert {c["codec"] for c in report["checks"]} == {"fp32", "fp4"} and report["runs"][0]["rtt_ms"] == rtt
        assert "adloco-1t-h50" in report["runs"][0]["results"]
    elif kind == "latency":
        assert report["runs"][0]["measured_rtt_ms"] == 0.5 and "checks" in report
    else:
        assert set(report["rates"]) == {"100"} and "targets" in report


def test_rates_and_links_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        link.main(["--adaptive", "--links", "100@50", "--rates", "100"])
    assert exit_info.value.code == 2 and "--rates and --links exclude each other" in capsys.readouterr().err


def test_reuse_takes_a_run_only_with_the_same_budget_seed_and_corpus(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n" * 100)
    (run_dir / "config.yaml").write_text("total_tokens: 1000\nseed: 0\ndata:\n  dataset: tinyshakespeare\n")
    assert link._same_run(run_dir, ["total_tokens=1000", "seed=0"])
    assert not link._same_run(run_dir, ["total_tokens=2000", "seed=0"])
    assert not link._same_run(run_dir, ["total_tokens=1000", "seed=0", f"data.dataset={corpus}"])
