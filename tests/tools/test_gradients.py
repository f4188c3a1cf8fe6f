"""``adloco gradients`` end to end on a tiny finished run: report fields, files, loading paths, bad input."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from adloco import build_config, train
from adloco.checkpoint import list_checkpoints, load_checkpoint
from adloco.checkpoint.sharded import save_sharded_checkpoint
from adloco.cli import main
from adloco.models.build import build_model, next_token_loss, preset_config
from adloco.tools.gradients import analyze, parse_batch_sizes, parse_checkpoint, per_sample_gradients
from tests.conftest import FAST

SAMPLES = 32
BATCHES = [1, 2, 4, 8, 16, 32]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gradients")
    return train(build_config(overrides=[*FAST, "threads=1", f"run.root={root}"])).run_dir


@pytest.fixture(scope="module")
def report(run_dir):
    return analyze(run_dir, samples=SAMPLES, batch_sizes=BATCHES, repeats=4000, seed=3, threads=1)


@pytest.mark.training
def test_report_is_consistent(run_dir, report):
    saved = json.loads((run_dir / "gradients" / "report.json").read_text())
    assert (
        saved["samples"] == SAMPLES
        and saved["task"] == "lm"
        and saved["source"] == {"kind": "final", "round": None, "trainer": 0}
    )
    for name in ("report.json", "deviations.png", "deviation_vs_batch.png"):
        assert (run_dir / "gradients" / name).stat().st_size > 0
    g2, trace = saved["grad_norm_sq"], saved["trace_cov"]
    assert g2 > 0 and trace > 0
    assert saved["noise_scale"] == pytest.approx(trace / g2, rel=1e-12)
    assert saved["unbiased_grad_norm_sq"] == pytest.approx(g2 - trace / SAMPLES, rel=1e-12)
    # Per-sample gradients averaged must equal the gradient of the mean loss over all windows.
    assert saved["mean_gradient_check"] < 1e-8
    assert [row["batch"] for row in saved["batch_sizes"]] == BATCHES
    for row in saved["batch_sizes"]:
        b = row["batch"]
        assert row["predicted"] == pytest.approx(trace * (1 - b / SAMPLES) / (b * g2), rel=1e-9, abs=1e-15)
        assert row["predicted_with_replacement"] == pytest.approx(trace / (b * g2), rel=1e-9)
        if b < SAMPLES:
            assert 0.5 < row["ratio"] < 2.0, row
        else:
            assert row["measured"] < 1e-9  # the whole population is the full gradient
    means = [row["measured"] for row in saved["batch_sizes"]]
    assert means == sorted(means, reverse=True)


def test_batch_tests_and_run_batch(report):
    norm, inner = report["norm_test"], report["inner_product_test"]
    assert norm["workers"] == 2 and norm["eta"] == 0.8
    assert norm["raw_request"] == pytest.approx(
        report["trace_cov"] / report["unbiased_grad_norm_sq"] / 0.64 / 2, rel=1e-9
    )
    low, high = report["b_bounds"]
    assert low <= norm["b_req"] <= high and low <= inner["b_req"] <= high
    assert inner["raw_request"] == max(inner["ip_request"], inner["orth_request"])
    assert report["run_batch"] == 2  # FAST: batch.size=2, constant b for DiLoCo


@pytest.mark.training
def test_checkpoint_of_the_same_trainer_gives_the_same_numbers(run_dir, report, tmp_path):
    other = analyze(
        run_dir,
        checkpoint="latest",
        samples=SAMPLES,
        batch_sizes=[4],
        repeats=10,
        seed=3,
        out_dir=tmp_path,
        plots=False,
    )
    assert other["source"]["kind"] == "checkpoint" and other["source"]["trainer"] == 0
    assert other["grad_norm_sq"] == pytest.approx(report["grad_norm_sq"], rel=1e-6)
    assert other["trace_cov"] == pytest.approx(report["trace_cov"], rel=1e-6)
    assert other["run_batch"] == 2
    assert (tmp_path / "report.json").exists() and not (tmp_path / "deviations.png").exists()


def test_per_sample_gradients_match_single_backward():
    model = build_model(preset_config("tiny", 256, 8), 0)
    inputs = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(1))
    rows = per_sample_gradients(model, next_token_loss, (inputs, targets))
    next_token_loss(model, inputs[1:2], targets[1:2]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(rows[1], expected)


def test_parsers():
    assert parse_batch_sizes("8, 1,2,2", 8) == [1, 2, 8]
    assert parse_batch_sizes(None, 10) == [1, 2, 4, 8]
    assert parse_checkpoint("12") == 12 and parse_checkpoint(None) is None and parse_checkpoint("final") == "final"


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["gradients", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-sizes", "1,x"], "'x' is not an integer"),
        (["--batch-sizes", "0,2"], "0 is outside 1..8"),
        (["--batch-sizes", "2,9"], "9 is outside 1..8"),
        (["--samples", "1"], "--samples must be >= 2"),
        (["--checkpoint", "7"], "no checkpoint of round 7"),
        (["--checkpoint", "best"], "--checkpoint must be"),
        (["--checkpoint", "latest", "--trainer", "5"], "has no trainer 5"),
    ],
)
def test_bad_arguments_are_one_line_errors(run_dir, capsys, args, message):
    code, err = run_cli(capsys, str(run_dir), "--samples", "8", *args)
    assert code == 2
    assert message in err and err.startswith("adloco: error:") and len(err.splitlines()) == 1


def test_run_without_model_or_checkpoint(run_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.yaml", bare / "config.yaml")
    code, err = run_cli(capsys, str(bare))
    assert code == 2 and "neither an exported model" in err and len(err.splitlines()) == 1
    code, err = run_cli(capsys, str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err


def test_cli_prints_tables(run_dir, tmp_path, capsys):
    code = main(
        ["gradients", str(run_dir), "--samples", "8", "--batch-sizes", "2,4", "--repeats", "50"]
        + ["--out", str(tmp_path), "--threads", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "B_simple" in out and "norm test" in out and str(tmp_path / "report.json") in out
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [row["batch"] for row in saved["batch_sizes"]] == [2, 4] and math.isfinite(saved["noise_scale"])


@pytest.mark.training
def test_a_sharded_checkpoint_reads_as_the_single_file_one(run_dir, report, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    newest = list_checkpoints(copy / "checkpoints")[-1]
    state = load_checkpoint(newest)
    shutil.rmtree(copy / "checkpoints")
    save_sharded_checkpoint(copy / "checkpoints", state["round"], state, 2, 0, lambda: None, distributed=False)
    other = analyze(
        copy, checkpoint=state["round"], samples=SAMPLES, batch_sizes=[4], repeats=10, seed=3, out_dir=tmp_path
    )
    assert other["grad_norm_sq"] == pytest.approx(report["grad_norm_sq"], rel=1e-6)
    assert other["trace_cov"] == pytest.approx(report["trace_cov"], rel=1e-6)
