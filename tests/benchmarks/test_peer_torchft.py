"""benchmarks/peer_torchft.py: parameter agreement, the report's target line, and a tiny run against torchft."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_torchft.py"
_spec = importlib.util.spec_from_file_location("adloco_peer_benchmark", _PATH)
peer = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = peer
_spec.loader.exec_module(peer)


def test_agreement_of_two_parameter_sets():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0]), "only_a": torch.zeros(1)}
    same = peer.agreement(a, {k: v.clone() for k, v in a.items() if k != "only_a"})
    assert same == {"tensors": 2, "bit_identical": True, "max_abs_diff": 0.0, "relative_l2": 0.0}
    moved = peer.agreement(a, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.5])})
    assert not moved["bit_identical"] and moved["max_abs_diff"] == 0.5
    assert moved["relative_l2"] == pytest.approx(0.5 / 14**0.5)
    with pytest.raises(RuntimeError, match="no parameter names"):
        peer.agreement({"x": torch.zeros(1)}, {"y": torch.zeros(1)})


def _report(adloco_tps, torchft_tps):
    median = {"adloco": adloco_tps, "torchft": torchft_tps}
    return {
        "date": "2026-01-01",
        "command": "python benchmarks/peer_torchft.py",
        "versions": {"adloco": "0.1.0", "torchft": "0.2.0", "torch": "2.13.0", "python": "3.11"},
        "machine": "cpu, 2 cores",
        "tokens": 192_000,
        "sync_every": 10,
        "seed": 0,
        "repeats": 1,
        "tokens_per_second": {side: [v] for side, v in median.items()},
        "median_tokens_per_second": median,
        "ratio_adloco_over_torchft": [adloco_tps / torchft_tps],
        "median_ratio": adloco_tps / torchft_tps,
        "val_loss": {"adloco": 2.0, "torchft": 2.0},
        "agreement": {"tensors": 39, "bit_identical": False, "max_abs_diff": 1e-6, "relative_l2": 2e-7},
        "adloco_repeatable": True,
    }


def test_the_report_states_the_throughput_target_with_its_figure():
    met = peer.markdown(_report(3000.0, 2400.0))
    assert "**met** (1.25×)" in met and "| 3,000 | 2.0000 |" in met
    assert "max abs diff 1e-06, relative L2 2e-07" in met and "adloco run to run: bit-identical" in met
    assert "**not met** (0.80×)" in peer.markdown(_report(2400.0, 3000.0))


def _torchft_missing() -> str | None:
    try:
        from torchft._torchft import LighthouseServer  # noqa: F401
    except Exception as error:  # the optional extra is not installed, or its compiled part does not load
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.process
@pytest.mark.skipif(_torchft_missing() is not None, reason="torchft (extra 'torchft') unavailable")
def test_a_tiny_run_matches_torchft_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("RUST_LOG", "warn")
    out = tmp_path / "result.json"
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{peer.BEGIN}\n{peer.END}\n")
    # 64 tokens a step, H = 2: 6 steps, 3 rounds, the last two timed on both sides.
    tiny = ["model.context=16", "batch.size=2", "inner.warmup_steps=1", "eval.blocks=4"]
    argv = ["--tokens", "384", "--sync-every", "2", "--repeats", "1", "--out", str(tmp_path / "runs")]
    assert peer.main([*argv, "--json", str(out), "--write", "--doc", str(doc), *tiny]) == 0
    report = json.loads(out.read_text())
    assert report["agreement"]["bit_identical"] and report["agreement"]["tensors"] > 0
    assert report["val_loss"]["adloco"] == report["val_loss"]["torchft"]
    assert all(v > 0 for v in report["median_tokens_per_second"].values())
    assert report["versions"]["torchft"] and "cores" in report["machine"]
    assert "Target: throughput ≥ torchft's" in doc.read_text() and doc.read_text().startswith("intro\n")
