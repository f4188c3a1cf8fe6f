"""Trackers: TensorBoard event files of a real run (and after a resume), missing packages, MLflow, W&B, ClearML."""

import math
import re
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from adloco.cli import main
from adloco.config import ConfigError, build_config
from adloco.metrics.tracking import ClearmlTracker, FanOut, MlflowTracker, TensorBoardTracker, WandbTracker, scalars_of
from adloco.metrics.writer import MetricsWriter, read_metrics
from adloco.run.training import train
from tests.conftest import FAST, cut_back

RESUMABLE = [*FAST, "total_tokens=768", "checkpoint.every=1", "checkpoint.keep=10"]


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return train(build_config(overrides=[*RESUMABLE, f"run.root={tmp_path_factory.mktemp('runs')}"]))


def test_tensorboard_holds_the_metrics_of_every_step_and_round(full_run):
    records = read_metrics(full_run.run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    rounds = [r for r in records if r["kind"] == "round"]
    scalars = _scalars(full_run.run_dir / "tensorboard")
    # train loss per trainer at every global inner step, equal to metrics.jsonl (TensorBoard stores float32)
    assert [s for s, _ in scalars["train/loss/trainer_0"]] == [r["step"] for r in steps]
    assert all(
        math.isclose(v, r["loss"]["0"], rel_tol=1e-6)
        for (_, v), r in zip(scalars["train/loss/trainer_0"], steps, strict=True)
    )
    assert all(math.isclose(v, r["lr"], rel_tol=1e-6) for (_, v), r in zip(scalars["train/lr"], steps, strict=True))
    # round metrics at the inner step that ended the round
    evaluated = [r for r in rounds if r["val_loss"]]
    assert [(s, round(v, 5)) for s, v in scalars["val/loss/trainer_0"]] == [
        (r["step"], round(r["val_loss"]["0"], 5)) for r in evaluated
    ]
    assert [v for _, v in scalars["batch/b/trainer_0"]] == [2.0] * len(rounds)
    assert [v for _, v in scalars["comm/bytes_total"]] == [float(r["bytes_total"]) for r in rounds]
    assert all(v > 0 for _, v in scalars["perf/tokens_per_second"])
    assert all(v > 10 for _, v in scalars["memory/rank_0/rss_mib"])  # a Python process with torch loaded
    assert scalars["final/val_loss/trainer_0"][0][1] == pytest.approx(full_run.val_loss, rel=1e-6)


def test_round_records_report_memory_per_rank(full_run):
    rounds = [r for r in read_metrics(full_run.run_dir / "metrics.jsonl") if r["kind"] == "round"]
    for record in rounds:
        (memory,) = record["memory"]
        assert memory["rank"] == 0 and 10 < memory["rss_mib"] <= memory["peak_rss_mib"] + 1e-6


def test_resume_hides_the_replaced_points_in_tensorboard(full_run, tmp_path):
    partial = cut_back(full_run.run_dir, tmp_path / "partial", keep=1)
    config = build_config(overrides=[*RESUMABLE, f"run.root={tmp_path}"])
    train(config, resume=partial)
    assert len(list((partial / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the old file is kept
    expected, got = _scalars(full_run.run_dir / "tensorboard"), _scalars(partial / "tensorboard")
    for tag in ("train/loss/trainer_0", "val/loss/trainer_0", "batch/b/trainer_0", "progress/tokens"):
        # every step once, in order, with the values of the run that was never interrupted (bit-identical on CPU)
        assert got[tag] == expected[tag], tag


def test_trackers_can_be_switched_off(tmp_path):
    result = train(build_config(overrides=[*FAST, "total_tokens=128", "run.trackers=[]", f"run.root={tmp_path}"]))
    assert not (result.run_dir / "tensorboard").exists()


@pytest.mark.parametrize(("name", "extra"), [("wandb", "adloco[wandb]"), ("clearml", "adloco[clearml]")])
def test_a_missing_tracker_is_a_one_line_error_before_training(name, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed, whatever this machine has
    with pytest.raises(ConfigError, match=f"'{name}' is not installed.*pip install '{re.escape(extra)}'"):
        train(build_config(overrides=[*FAST, f"run.trackers=[tensorboard,{name}]", f"run.root={tmp_path}"]))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing was started
    code = main(["train", *FAST, f"run.trackers={name}", f"run.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and extra in err


def test_tensorboard_merges_as_text_and_purge_on_resume(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", trackers=[TensorBoardTracker(tmp_path / "tb")])
    for step in range(1, 7):
        writer.write("step", round=(step - 1) // 3, step=step, loss={"0": 10.0 - step, "1": 9.0}, lr=0.1, tokens=step)
    writer.write("merge", round=1, merged=[0, 1], into=0, weights=[0.25, 0.75], batch_size=3, workers=[0, 1])
    writer.close()
    # a second process resumes from step 3: steps 4..6 are written again with other values
    writer = MetricsWriter(tmp_path / "metrics.jsonl", trackers=[TensorBoardTracker(tmp_path / "tb", purge_step=4)])
    for step in range(4, 7):
        writer.write("step", round=(step - 1) // 3, step=step, loss={"0": 100.0 + step}, lr=0.1, tokens=step)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss/trainer_0")] == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 104.0),
        (5, 105.0),
        (6, 106.0),
    ]
    assert [e.step for e in events.Scalars("train/loss/trainer_1")] == [1, 2, 3]  # purged, not rewritten
    (text,) = events.Tensors("merges/text_summary")  # add_text writes a text tensor
    assert text.step == 6 and b"trainers [0, 1] merged into 0" in text.tensor_proto.string_val[0]


def test_round_records_become_scalars_and_non_finite_values_are_skipped():
    record = {
        "round": 2,
        "step": 12,
        "train_loss": {"0": 2.5, "1": "nan"},
        "val_loss": None,
        "batch": {"0": 4, "1": 6},
        "bytes": 10,
        "memory": [{"rank": 0, "rss_mib": 100.0, "peak_rss_mib": 120.0}, {"rank": 1, "rss_mib": 90.0}],
        "merge": {"into": 0},
    }
    scalars = scalars_of("round", record)
    assert scalars["round/train_loss/trainer_0"] == 2.5 and "round/train_loss/trainer_1" not in scalars
    assert scalars["batch/b/trainer_1"] == 6 and scalars["progress/round"] == 2 and scalars["merge/merged"] == 1
    assert scalars["memory/rank_1/rss_mib"] == 90.0 and scalars["memory/rank_0/peak_rss_mib"] == 120.0
    assert not any(tag.startswith("val/") for tag in scalars)


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def record(self, kind, fields, step):
        if self.fail:
            raise ConnectionError("service unreachable")
        self.calls.append((kind, step))

    def flush(self):
        pass

    def close(self):
        self.calls.append(("closed", None))


def test_fan_out_gives_records_a_step_and_drops_a_failing_tracker():
    good, bad = _Recorder(), _Recorder(fail=True)
    fan = FanOut([bad, good])
    fan.record("step", {"step": 5, "loss": {}})
    fan.record("merge", {"round": 0})  # no step of its own: belongs to the last step seen
    fan.close()
    assert good.calls == [("step", 5), ("merge", 5), ("closed", None)]
    assert fan.trackers == [] and bad.calls == [("closed", None)]  # the failed one was closed and dropped


@pytest.mark.process
def test_mlflow_tracker_logs_to_a_local_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # the [mlflow] extra; the file store needs no server or network
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store only on request
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracker = MlflowTracker(run_dir, "adloco-test", {"inner": {"lr": 0.001}, "method": "diloco"})
    fan = FanOut([tracker])
    fan.record("step", {"step": 1, "loss": {"0": 3.0}, "lr": 0.001, "tokens": 64})
    fan.record("step", {"step": 2, "loss": {"0": 2.0}, "lr": 0.001, "tokens": 128})
    fan.record("merge", {"round": 0, "merged": [0, 1], "into": 0, "weights": [0.5, 0.5]})
    fan.close()
    run_id = (run_dir / "tracking" / "mlflow_run_id").read_text().strip()
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(run_id, "train/loss/trainer_0")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0)]
    assert client.get_run(run_id).data.params["inner.lr"] == "0.001"
    # a resumed run continues the same MLflow run
    again = MlflowTracker(run_dir, "adloco-test", {})
    assert again.run.info.run_id == run_id
    again.close()


def test_wandb_adapter_against_a_recording_fake(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class FakeRun:
        summary: dict = {}

        def log(self, data, step):
            calls.append(("log", dict(data), step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = WandbTracker(tmp_path / "my-run", "proj", {"seed": 0})
    tracker.record("step", {"step": 3, "loss": {"0": 1.5}, "lr": 0.01}, 3)
    tracker.record("merge", {"round": 1, "merged": [0, 1], "into": 1, "weights": [0.5, 0.5]}, 3)
    tracker.close()
    assert calls[0][1]["project"] == "proj" and calls[0][1]["id"] == "my-run" and calls[0][1]["resume"] == "allow"
    assert calls[1] == ("log", {"train/loss/trainer_0": 1.5, "train/lr": 0.01}, 3)
    assert "merged into 1" in FakeRun.summary["merges"] and calls[-1] == ("finish",)


def test_clearml_adapter_against_a_recording_fake(tmp_path, monkeypatch):
    reported: list[tuple] = []

    class FakeLogger:
        def report_scalar(self, title, series, value, iteration):
            reported.append((title, series, value, iteration))

        def report_text(self, text, iteration):
            reported.append(("text", text, iteration))

        def flush(self):
            pass

    class FakeTask:
        @classmethod
        def init(cls, project_name, task_name, reuse_last_task_id):
            reported.append(("init", project_name, task_name))
            return cls()

        def connect(self, params):
            reported.append(("params", params))

        def get_logger(self):
            return FakeLogger()

        def close(self):
            reported.append(("close",))

    fake = types.ModuleType("clearml")
    fake.Task = FakeTask
    monkeypatch.setitem(sys.modules, "clearml", fake)
    tracker = ClearmlTracker(tmp_path / "r", "proj", {"inner": {"lr": 0.5}})
    tracker.record("round", {"round": 0, "val_loss": {"0": 2.0}, "batch": {"0": 4}}, 8)
    tracker.close()
    assert reported[0] == ("init", "proj", "r") and reported[1] == ("params", {"inner.lr": 0.5})
    assert ("val/loss", "trainer_0", 2.0, 8) in reported and ("batch/b", "trainer_0", 4.0, 8) in reported
    assert reported[-1] == ("close",)
