"""metrics/plots.py on hand-written metrics: merges marked, memory plotted, runs without either still plotted."""

import json
import warnings

import pytest

from adloco.checkpoint import CheckpointError
from adloco.errors import DataError
from adloco.metrics.plots import plot_run

PNG = b"\x89PNG\r\n\x1a\n"


def _write(run_dir, merges: bool, memory: bool, cuda: bool = False, lr_scale: bool = False, sent: bool = True,
           auto: bool = False) -> None:  # fmt: skip
    lines = []
    for r in range(6):
        record = {
            "kind": "round",
            "round": r,
            "step": 4 * (r + 1),
            "tokens": 256 * (r + 1),
            "bytes_total": 1000 * (r + 1) if sent else 0,
            "train_loss": {"0": 5.0 - 0.3 * r, "1": 5.1 - 0.3 * r} if r < 3 else {"0": 4.0 - 0.1 * r},
            "val_loss": {"0": 5.0 - 0.25 * r} if r % 2 else None,
            "batch": {"0": 2 + r, "1": 3} if r < 3 else {"0": 6},
        }
        if lr_scale:
            record["lr_scale"] = {k: (b / 2) ** 0.5 for k, b in record["batch"].items()}
        if auto:
            record.update(sync_every=4 * 2**r, sync={"sync_every": 8 * 2**r, "reason": "grow"})
        if memory:
            record["memory"] = [
                {"rank": k, "rss_mib": 300.0 + 10 * r + k, "peak_rss_mib": 320.0 + 10 * r} for k in (0, 1)
            ]
            if cuda:
                for entry in record["memory"]:
                    entry.update(cuda_allocated_mib=50.0 + r, cuda_peak_allocated_mib=80.0 + r)
        lines.append(record)
        if merges and r == 2:
            lines.append({"kind": "merge", "round": 2, "merged": [0, 1], "into": 0, "weights": [0.5, 0.5]})
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.training
def test_plots_with_merges_and_memory(tmp_path):
    _write(tmp_path / "a", merges=True, memory=True)
    _write(tmp_path / "b", merges=False, memory=True)
    paths = plot_run(tmp_path / "a")
    assert [p.name for p in paths] == ["loss.png", "batch.png", "memory.png"]
    assert all(p.read_bytes()[:8] == PNG and p.stat().st_size > 5000 for p in paths)
    plain = plot_run(tmp_path / "b")
    # the merge markers change the loss and batch pictures; memory.png shows them too
    for with_merge, without in zip(paths, plain, strict=True):
        assert with_merge.read_bytes() != without.read_bytes()


def _width(png) -> int:
    from PIL import Image

    with Image.open(png) as image:
        return image.size[0]


@pytest.mark.training
def test_cuda_memory_gets_its_own_panel(tmp_path):
    _write(tmp_path / "cpu", merges=False, memory=True)
    _write(tmp_path / "gpu", merges=False, memory=True, cuda=True)
    cpu, gpu = _width(plot_run(tmp_path / "cpu")[2]), _width(plot_run(tmp_path / "gpu")[2])
    assert gpu > cpu * 1.5  # two panels side by side


def test_h_chosen_while_training_gets_its_own_panel(tmp_path):
    _write(tmp_path / "fixed", merges=False, memory=False)
    _write(tmp_path / "auto", merges=False, memory=False, auto=True)
    fixed, auto = _width(plot_run(tmp_path / "fixed")[1]), _width(plot_run(tmp_path / "auto")[1])
    assert auto > fixed * 1.5  # b and H side by side


def test_the_inner_lr_factor_is_drawn_beside_b_when_recorded(tmp_path):
    _write(tmp_path / "plain", merges=True, memory=False)
    _write(tmp_path / "coupled", merges=True, memory=False, lr_scale=True)
    plain, coupled = _width(plot_run(tmp_path / "plain")[1]), _width(plot_run(tmp_path / "coupled")[1])
    assert coupled > plain * 1.5  # b and the lr factor side by side


def test_a_run_without_merges_or_memory_still_plots(tmp_path):
    _write(tmp_path / "old", merges=False, memory=False)
    paths = plot_run(tmp_path / "old")
    assert [p.name for p in paths] == ["loss.png", "batch.png"]
    assert all(p.stat().st_size > 5000 for p in paths)
    assert not (tmp_path / "old" / "plots" / "memory.png").exists()


def test_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no metrics.jsonl"):
        plot_run(tmp_path)


def test_a_run_that_sent_nothing_is_plotted_without_complaint(tmp_path):
    """One worker sends no bytes: its bytes axis stays linear instead of warning about a log scale of zeros."""
    _write(tmp_path / "run", merges=False, memory=False, sent=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = plot_run(tmp_path / "run")
    assert paths and all(p.read_bytes().startswith(PNG) for p in paths)


@pytest.mark.parametrize(
    "damage",
    [
        b"\xe4\x00\xff" * 50,  # binary garbage
        b'{"kind": "round", "round": 1}\n[1]\n3\n',  # lines that are not records
        b'{"kind": "step", "round": 1}\n',  # records, but no completed round
    ],
)
def test_damaged_metrics_are_an_error_and_good_plots_stay(tmp_path, damage):
    _write(tmp_path / "run", merges=False, memory=True)
    before = {p.name: p.read_bytes() for p in plot_run(tmp_path / "run")}
    (tmp_path / "run" / "metrics.jsonl").write_bytes(damage)
    with pytest.raises(DataError, match="damaged|no completed round"):
        plot_run(tmp_path / "run")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "plots").iterdir()} == before


def test_a_torn_last_line_is_a_write_cut_short_not_damage(tmp_path):
    _write(tmp_path / "run", merges=False, memory=False)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"kind": "ro')  # no line break: the process died mid-write
    assert [p.name for p in plot_run(tmp_path / "run")] == ["loss.png", "batch.png"]


def test_records_without_bytes_or_by_trainer_losses_still_plot(tmp_path):
    """A fault-tolerant replica's records from before they carried bytes and losses by trainer: the loss plot
    draws what they have instead of stopping with a traceback."""
    _write(tmp_path / "old", merges=True, memory=False)
    lines = [json.loads(line) for line in (tmp_path / "old" / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        record.pop("bytes_total", None)
        if record["kind"] == "round":
            record["train_loss"] = 4.0
    (tmp_path / "old" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    paths = plot_run(tmp_path / "old")
    assert [p.name for p in paths] == ["loss.png", "batch.png"] and all(p.read_bytes()[:8] == PNG for p in paths)
