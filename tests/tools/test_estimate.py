"""``adloco estimate`` end to end: a real tiny run, runs written from the model itself, and bad input."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from adloco import build_config, train
from adloco.algorithms.schedules import inner_lr
from adloco.algorithms.theory import norm_test_batch
from adloco.cli import main
from adloco.metrics.writer import read_metrics
from adloco.tools.estimate import HORIZON, estimate
from tests.conftest import FAST

ROUNDS = 8  # FAST: 2 workers × b 2 × context 16 × 4 steps = 256 tokens a round


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate")
    overrides = [
        *FAST,
        f"total_tokens={256 * ROUNDS}",
        # The norm test with b pinned to 2 measures ‖∇F‖² and σ² every round without changing the batch.
        "batch.test=norm",
        "batch.b_min=2",
        "batch.b_cap=2",
        "threads=1",
        "eval.every=1000",
        "checkpoint.every=1000",
        "run.trackers=[]",
        "run.save_final=false",
        f"run.root={root}",
    ]
    return train(build_config(overrides=overrides)).run_dir


def _losses(run_dir) -> list[float]:
    return [r["train_loss"]["0"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["estimate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.training
def test_json_and_text_output_on_a_real_run(run_dir, capsys):
    losses = _losses(run_dir)
    assert len(losses) == ROUNDS
    # Default calibration: max(3, 20 % of 8) = 3 rounds; aim at the best loss reached after them.
    later = min(losses[3:])
    target = math.ceil(later * 1e4) / 1e4
    assert target < min(losses[:3]), "the tiny run must still improve after its calibration rounds"
    code, out, err = _cli(capsys, str(run_dir), "--target", str(target), "--json")
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["method"] == "diloco" and result["trainer"] == 0 and result["rounds_in_run"] == ROUNDS
    cal = result["calibration"]
    assert (cal["rounds"], cal["first_round"], cal["last_round"], cal["fit_first_round"]) == (3, 1, 3, 2)
    assert cal["loss_start"] == pytest.approx(losses[0]) and cal["loss_end"] == pytest.approx(losses[2])
    assert cal["scale"] > 0 and cal["slope"] >= 0 and cal["grad_norm_sq"] > 0 and cal["sample_variance"] > 0
    assert cal["noise_scale"] == pytest.approx(cal["sample_variance"] / cal["grad_norm_sq"])
    assert cal["merges"] == 0 and result["merges_after_calibration"] == 0
    pred = result["prediction"]
    assert pred["reachable"] and not pred.get("during_calibration")
    assert isinstance(pred["rounds"], int) and 3 < pred["rounds"] < HORIZON * ROUNDS
    assert pred["rounds"] == pred["round"] == 3 + pred["more_rounds"]  # rounds are counted from 1
    assert pred["synchronisations"] == pred["rounds"]  # DiLoCo: one exchange a round
    assert pred["tokens"] == 256 * pred["rounds"] and pred["final_batch"] == 2
    first = next(i for i, loss in enumerate(losses, start=1) if loss <= target)
    measured = result["measured"]
    assert measured == {"round": first, "rounds": first, "tokens": 256 * first, "synchronisations": first}
    assert result["relative_error"] == pytest.approx((pred["rounds"] - first) / first)

    code, out, err = _cli(capsys, str(run_dir), "--target", str(target))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"run {run_dir} (diloco, trainer 0, {ROUNDS} rounds)")
    assert lines[1].startswith("calibrated on rounds 1-3 (fit on 2-3)") and "kappa" in lines[1]
    assert lines[2].startswith(f"predicted: loss {target:g} at round {pred['round']} ({pred['rounds']} rounds")
    assert lines[3].startswith(f"measured: loss {target:g} at round {first} ")
    assert lines[4].startswith("relative error in rounds:")


def test_more_calibration_rounds_and_a_target_the_run_missed(run_dir, capsys):
    losses = _losses(run_dir)
    target = round(min(losses) - 0.05, 3)  # below anything the run reached
    code, out, _ = _cli(capsys, str(run_dir), "--target", str(target), "--calibrate-rounds", "6", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["calibration"]["last_round"] == 6 and result["calibration"]["fit_first_round"] == 4
    assert result["prediction"]["rounds"] > 6 and math.isfinite(result["prediction"]["tokens"])
    assert result["measured"] is None and result["relative_error"] is None
    code, out, _ = _cli(capsys, str(run_dir), "--target", str(target))
    assert f"measured: the run did not reach loss {target:g}" in out and "relative error" not in out


def test_a_target_reached_during_calibration_reports_that_round(run_dir, capsys):
    losses = _losses(run_dir)
    target = math.ceil(losses[1] * 1e4) / 1e4  # reached at round 2 (or 1), inside the 3 calibration rounds
    first = next(i for i, loss in enumerate(losses, start=1) if loss <= target)
    code, out, _ = _cli(capsys, str(run_dir), "--target", str(target), "--json")
    assert code == 0
    result = json.loads(out)
    pred = result["prediction"]
    assert pred["during_calibration"] and pred["reachable"] and pred["more_rounds"] == 0
    assert pred["round"] == result["measured"]["round"] == first and pred["rounds"] == first
    assert result["relative_error"] is None  # an observation, not a prediction
    code, out, _ = _cli(capsys, str(run_dir), "--target", "100")
    assert code == 0 and "reached loss 100 at round 1, during the calibration rounds" in out


def _one_line_error(capsys, *args: str) -> str:
    try:
        code = main(["estimate", *args])
    except SystemExit as stop:  # argparse's own errors (a value that is not a number, a missing option)
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("adloco: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys):
    run = str(run_dir)
    assert "does not exist" in _one_line_error(capsys, str(tmp_path / "nope"), "--target", "2")
    assert "not a run directory" in _one_line_error(capsys, str(tmp_path), "--target", "2")
    for bad in ("nan", "inf", "-inf", "0", "-1"):
        assert "--target must be a finite loss > 0" in _one_line_error(capsys, run, f"--target={bad}")
    assert "invalid float value" in _one_line_error(capsys, run, "--target", "low")
    assert "required" in _one_line_error(capsys, run)
    # A target the model never reaches: it says so instead of printing a prediction.
    err = _one_line_error(capsys, run, "--target", "0.01")
    assert "is not reached under the model calibrated on rounds 1-3" in err
    assert f"within {HORIZON * ROUNDS} rounds" in err
    for bad in ("2", "0", "-3"):
        err = _one_line_error(capsys, run, "--target", "3", f"--calibrate-rounds={bad}")
        assert "--calibrate-rounds must be an integer >= 3" in err
    assert "invalid int value" in _one_line_error(capsys, run, "--target", "3", "--calibrate-rounds", "x")
    err = _one_line_error(capsys, run, "--target", "3", "--calibrate-rounds", "9")
    assert f"has {ROUNDS} rounds of trainer 0, --calibrate-rounds asks for 9" in err
    assert "no completed rounds of trainer 3" in _one_line_error(capsys, run, "--target", "3", "--trainer", "3")


def test_runs_without_statistics_or_metrics(run_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    shutil.copytree(run_dir, plain)
    records = read_metrics(plain / "metrics.jsonl")
    # What a run with the default batch.test=constant writes: no statistics in its round records.
    lines = [json.dumps({**r, "batch_test": None} if r["kind"] == "round" else r) for r in records]
    (plain / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    err = _one_line_error(capsys, str(plain), "--target", "3")
    assert "has no batch-test statistics" in err and "batch.test=norm" in err
    (plain / "metrics.jsonl").unlink()
    assert "has no metrics.jsonl" in _one_line_error(capsys, str(plain), "--target", "3")


# A run written from the model itself: the estimate must recover κ and β and hit the measured round exactly.
KAPPA, BETA, SCALE_G, SIGMA2, CONTEXT = 0.02, 1.5, 0.01, 4.0, 64


def _model_run(tmp_path, overrides: list[str], rounds: int = 30) -> tuple[object, list[float]]:
    config = build_config(overrides=["sync_every=10", "total_tokens=400000", *overrides])
    run = tmp_path / "model-run"
    run.mkdir()
    (run / "config.yaml").write_text(config.to_yaml())
    inner, workers, steps, ema = config.inner, config.workers, config.sync_every, config.batch.statistics.ema
    adaptive = config.batch.b_cap > config.batch.b_min
    loss, b, step, tokens = 4.0, config.batch.size, 0, 0
    smoothed: tuple[float, float] | None = None
    records, losses = [], []
    for r in range(rounds):
        per_step = workers * b * CONTEXT
        if r > 0:  # the round from the previous loss to this one, at this round's batch and learning rates
            lr = sum(inner_lr(step + s, (tokens + s * per_step) / config.total_tokens, inner.lr, inner.min_lr,
                              inner.warmup_steps) for s in range(steps)) / inner.lr  # fmt: skip
            g = SCALE_G * math.exp(BETA * loss)
            loss -= KAPPA * lr * g * (workers * b) / (workers * b + SIGMA2 / g)
        step, tokens = step + steps, tokens + steps * per_step
        g = SCALE_G * math.exp(BETA * loss)
        # What the batch test logs with batch.statistics.ema = a: a·previous + (1 − a)·this round's value.
        smoothed = (g, SIGMA2) if smoothed is None else (ema * smoothed[0] + (1 - ema) * g, SIGMA2)
        after = (
            norm_test_batch(g, SIGMA2, workers, config.batch.statistics.eta, b, config.batch.b_cap) if adaptive else b
        )
        records.append(
            {
                "kind": "round",
                "round": r + 1,
                "steps": steps,
                "step": step,
                "tokens": tokens,
                "train_loss": {"0": loss},
                "batch": {"0": after},
                "batch_test": {"0": {"grad_norm_sq": smoothed[0], "sample_variance": smoothed[1]}},
                "plan": {"0": {"micro": b, "accum": 1, "samples": b, "mode": "single"}},
                "workers": {"0": workers},
            }
        )
        losses.append(loss)
        b = after
    records.append({"kind": "final", "round": rounds, "best_trainer": 0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run, losses


@pytest.mark.parametrize(
    "overrides",
    [
        ["batch.test=norm", "batch.size=3", "batch.b_min=3", "batch.b_cap=3"],
        ["batch.test=norm", "batch.size=3", "batch.b_min=3", "batch.b_cap=3", "batch.statistics.ema=0.5"],
        ["batch.test=norm", "batch.size=1", "batch.statistics.eta=1.0", "batch.b_cap=64"],  # b grows during the run
    ],
    ids=["fixed-b", "ema", "norm-test"],
)
def test_a_run_that_follows_the_model_is_predicted_exactly(tmp_path, overrides):
    run, losses = _model_run(tmp_path, overrides)
    target = (losses[19] + losses[20]) / 2
    result = estimate(run, target, calibrate_rounds=6)
    cal = result["calibration"]
    assert cal["scale"] == pytest.approx(KAPPA, rel=1e-6)
    assert cal["slope"] == pytest.approx(BETA, rel=1e-9)
    assert cal["sample_variance"] == pytest.approx(SIGMA2, rel=1e-9)
    assert result["measured"]["round"] == 21  # records[20] is round 21: rounds are counted from 1
    assert result["prediction"]["round"] == 21 and result["relative_error"] == 0.0
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "round"]
    assert result["prediction"]["tokens"] == records[20]["tokens"]
    assert result["prediction"]["final_batch"] == records[20]["plan"]["0"]["samples"]
    if "batch.statistics.eta=1.0" in overrides:
        assert records[5]["batch"]["0"] < result["prediction"]["final_batch"], "b must grow after calibration"


def test_merges_of_the_followed_trainer_are_flagged(tmp_path, capsys):
    run, _ = _model_run(tmp_path, ["batch.test=norm", "batch.size=3", "batch.b_min=3", "batch.b_cap=3"])
    records = read_metrics(run / "metrics.jsonl")
    for r in records:
        if r["kind"] == "round" and r["round"] in (5, 11):
            r["merge"] = {"merged": [0, 1], "into": 0, "weights": [0.5, 0.5], "batch_size": 3, "workers": [0, 1]}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = estimate(run, 2.0, calibrate_rounds=6)
    assert result["calibration"]["merges"] == 1 and result["merges_after_calibration"] == 1
    code, out, _ = _cli(capsys, str(run), "--target", "2.0", "--calibrate-rounds", "6")
    assert code == 0 and "took part in 2 merge(s) (1 during calibration)" in out.splitlines()[-1]
